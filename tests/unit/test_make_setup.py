"""`make setup` reinstalls torch when TORCH or TORCH_INDEX asks for another build than the
venv was set up with, also after an earlier set-up, and leaves it alone otherwise (the
Makefile's own rules, read by make's dry run in a copy of the project's Makefile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.unit

CPU = "https://download.pytorch.org/whl/cpu"
CUDA = "https://download.pytorch.org/whl/cu128"
NOTHING = "Nothing to be done for 'setup'"


@pytest.fixture
def project(tmp_path):
    """A folder with the Makefile and a venv set up before the stamp existed."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv").mkdir()
    installed = tmp_path / ".venv" / ".installed"
    installed.write_text("")
    past = time.time() - 60
    os.utime(tmp_path / "pyproject.toml", (past, past))
    return tmp_path


def dry_run(folder, *settings: str, env: dict[str, str] | None = None) -> str:
    """What ``make -n setup`` would run (make's own environment without TORCH*)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCH")}
    out = subprocess.run(
        ["make", "-n", "setup", *settings],
        cwd=folder,
        env=base | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def set_up(folder, *settings: str) -> None:
    """What the install leaves: the stamp it writes, then ``.installed`` touched."""
    lines = dry_run(folder, *settings).splitlines()
    stamp = next(line for line in lines if line.startswith("echo ") and ".venv/.torch" in line)
    subprocess.run(stamp, shell=True, cwd=folder, check=True)
    (folder / ".venv" / ".installed").touch()


def test_an_earlier_set_up_is_kept_until_another_build_is_asked_for(project):
    assert NOTHING in dry_run(project)
    again = dry_run(project, f"TORCH_INDEX={CUDA}")
    assert "pip uninstall --quiet --yes torch" in again
    assert f"pip install --quiet 'torch==2.13.0' --index-url '{CUDA}'" in again
    assert again.index("uninstall") < again.index("--index-url")
    set_up(project, f"TORCH_INDEX={CUDA}")
    assert (project / ".venv" / ".torch").read_text().strip() == f"torch==2.13.0 {CUDA}"
    # the same build again, or no TORCH* at all (make run, make test): nothing to do
    assert NOTHING in dry_run(project, f"TORCH_INDEX={CUDA}")
    assert NOTHING in dry_run(project)
    # another build, given in the environment this time
    assert "pip uninstall" in dry_run(project, env={"TORCH_INDEX": CPU})
    # back to the defaults (an empty index) and another version
    assert "pip uninstall" in dry_run(project, "TORCH_INDEX=")
    assert "'torch==2.12.0'" in dry_run(project, "TORCH=torch==2.12.0")


def test_a_changed_pyproject_reinstalls_without_touching_torch(project):
    set_up(project, f"TORCH_INDEX={CUDA}")
    (project / "pyproject.toml").touch()
    os.utime(project / ".venv" / ".installed", (time.time() - 30, time.time() - 30))
    out = dry_run(project)
    assert "pip install --quiet -e" in out and "pip uninstall" not in out
