"""The wheel holds every package and data file: pyproject's explicit package list is kept in
step with the folders (an editable install hides a missing entry; a plain install breaks)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every folder with an ``__init__.py`` under the mapped roots, by its dotted name."""
    found: dict[str, Path] = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            dotted = ".".join([name, *rel.parts]) if rel.parts else name
            found[dotted] = init.parent
    return found


def test_every_package_folder_is_in_the_package_list():
    folders = _package_folders()
    listed = set(SETUPTOOLS["packages"])
    assert set(folders) - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - set(folders) == set(), "listed packages without a folder"


def test_every_data_file_of_a_package_is_shipped():
    data = SETUPTOOLS["package-data"]
    missing = []
    for name, folder in _package_folders().items():
        globs = [*data.get("*", []), *data.get(name, [])]
        for path in folder.iterdir():
            if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py":
                continue
            if path.name == "__pycache__":
                continue
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(folder).as_posix()
                if not any(fnmatch.fnmatch(rel, g) for g in globs):
                    missing.append(f"{name}: {rel}")
    assert missing == [], "add these to [tool.setuptools.package-data]"
