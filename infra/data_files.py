"""Which files of a folder hold a split, for a folder laid out as a dataset hub's download.

A dataset downloaded from a hub (``huggingface-cli download``, ``snapshot_download``, a
``git clone``) is a folder of Parquet or JSONL files named for their split, as
``datasets`` reads them:

- ``data/train-00000-of-00002.parquet``, ``data/train-00001-of-00002.parquet``,
  ``data/test-00000-of-00001.parquet``;
- ``main/train-00000-of-00001.parquet`` (a dataset with several configurations keeps each
  in its own folder: ``main/``, ``socratic/``);
- ``train.jsonl``, ``test.jsonl``; or a folder per split, ``train/part-0.parquet``.

A file belongs to a split when a word of its path under the folder (a folder's name, or
the file's name cut at ``-``, ``_``, ``.``, spaces and digits) is one of the split's words
(:data:`SPLIT_WORDS`, as ``datasets`` names them: ``training`` is ``train``, ``dev`` and
``val`` are ``validation``); files none of which names a split are all ``train``. Hidden
folders (``.cache/`` of a download, ``.git/``) are passed over. The files of a split must
be of one format and in one folder of configurations; anything else is a
:class:`ConfigError` that says what the folder holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from streamrft.schemas.errors import ConfigError

FORMATS = (".parquet", ".jsonl")
"""The data files a hub folder may hold, by suffix."""
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""The words that name each split in a file's path (``datasets``' keywords); a split not
here is named by its own name."""
_CUTS = re.compile(r"[-_.\s\d]+")


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` is a dataset ``save_to_disk`` wrote (as ``load_from_disk`` tells
    one: a dataset dict's ``dataset_dict.json``, or a dataset's ``dataset_info.json`` and
    ``state.json``)."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "dataset_info.json").is_file() and (folder / "state.json").is_file()
    )


def data_files(folder: Path) -> list[Path]:
    """The Parquet and JSONL files under ``folder``, hidden folders passed over, in order
    of their paths (shards in their order)."""
    found = [
        p
        for p in folder.rglob("*")
        if p.suffix in FORMATS
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    ]
    return sorted(found, key=lambda p: p.relative_to(folder).parts)


def words(relative: Path) -> set[str]:
    """The words of a path under the folder: its folders' names and its file's name cut at
    separators and digits, lower case."""
    *folders, name = relative.parts
    cut = _CUTS.split(name.rsplit(".", 1)[0].lower())
    return {f.lower() for f in folders} | {w for w in cut if w}


def splits_named(relative: Path) -> set[str]:
    """The known splits (:data:`SPLIT_WORDS`) a file's path names."""
    have = words(relative)
    return {split for split, names in SPLIT_WORDS.items() if have.intersection(names)}


def split_files(folder: Path, split: str) -> list[Path]:
    """The files of ``split`` in ``folder`` (see the module docstring), or a
    :class:`ConfigError` saying why there are none to read."""
    files = data_files(folder)
    if not files:
        raise ConfigError(
            f"taskset {folder}: a folder must hold Parquet (.parquet) or JSONL (.jsonl) files, "
            "as a dataset hub's download does (data/train-00000-of-00001.parquet, "
            "train.jsonl), or be a dataset saved with datasets' save_to_disk "
            "(dataset_dict.json, or dataset_info.json and state.json); it holds none"
        )
    named = {p: splits_named(p.relative_to(folder)) for p in files}
    wanted = SPLIT_WORDS.get(split, (split.lower(),))
    chosen = [p for p in files if words(p.relative_to(folder)).intersection(wanted)]
    if not chosen and split == "train" and not any(named.values()):
        chosen = files  # no file names a split: all of them are the train split
    if not chosen:
        raise ConfigError(f"taskset.split: no {split!r} files in {folder}; {_holds(folder, named)}")
    _one_format(folder, split, chosen)
    _one_place(folder, split, chosen, wanted)
    return chosen


def _holds(folder: Path, named: dict[Path, set[str]]) -> str:
    splits = sorted({s for found in named.values() for s in found})
    first = next(iter(named)).relative_to(folder)
    if not splits:
        return f"none of its {len(named)} files names a split (such as {first}): all are 'train'"
    return f"its files name the splits {', '.join(splits)} (such as {first})"


def _one_format(folder: Path, split: str, files: Iterable[Path]) -> None:
    counts: dict[str, int] = {}
    for p in files:
        counts[p.suffix] = counts.get(p.suffix, 0) + 1
    if len(counts) > 1:
        mix = ", ".join(f"{n} {suffix}" for suffix, n in sorted(counts.items()))
        raise ConfigError(
            f"taskset {folder}: the {split!r} files are of mixed formats ({mix}); keep one "
            "format there, or point taskset.path at one file"
        )


def _one_place(folder: Path, split: str, files: Iterable[Path], wanted: Iterable[str]) -> None:
    """The files of a split lie in one folder of configurations: their folders, a folder
    named for the split left out, are the same."""
    names = set(wanted)
    places: dict[Path, Path] = {}
    for p in files:
        parts = [f for f in p.relative_to(folder).parts[:-1] if f.lower() not in names]
        places.setdefault(Path(*parts) if parts else Path("."), p)
    if len(places) > 1:
        where = ", ".join(str(place) for place in sorted(places))
        first = folder / sorted(places)[0]
        raise ConfigError(
            f"taskset {folder}: its {split!r} files are in several folders ({where}), a "
            f"dataset's configurations each in its own: point taskset.path at one of them "
            f"(such as {first})"
        )
