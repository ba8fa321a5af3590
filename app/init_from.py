"""``streamrft init --from-trinity FILE`` and ``streamrft init --from-verl 'KEY=VALUE ...'``
(or ``--from-verl FILE``): another framework's config converted, written, and checked.

The conversion itself is pure (:mod:`.convert_trinity`, :mod:`.convert_verl`); here the
source is read, the paths are made relative to the file written (a folder's evaluation
split taken by its files), ``--model`` and ``--data`` replace the converted paths, and the
config is written as ``init`` writes one: each field after its documentation's first
sentence and the reason of its value (where it came from; a default that differs, both
said), then the notes and the keys with no counterpart as a comment block. The same is
printed, and ``validate``'s checks after it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from streamrft.app.conversion import Conversion, comment_block, hub_name, shown
from streamrft.infra.config import from_dict
from streamrft.schemas.errors import ConfigError

PATH_FIELDS = ("model.path", "taskset.path", "eval.path", "algorithm.expert_data")
"""The converted fields that hold a file or folder (and each ``taskset.sources`` path)."""


def read_trinity(path: Path) -> Conversion:
    """The conversion of the Trinity-RFT config file at ``path``."""
    from streamrft.app.convert_trinity import convert

    if not path.is_file():
        raise ConfigError(f"--from-trinity: {path} is not a file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"--from-trinity: {path} is not YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--from-trinity: {path} holds no mapping of keys")
    return convert(data, os.environ)


def read_verl(given: str) -> Conversion:
    """The conversion of a verl command line: ``given`` itself, or the file it names."""
    from streamrft.app.convert_verl import convert, parse_overrides

    path = Path(given)
    text = path.read_text() if "=" not in given and path.is_file() else given
    overrides = parse_overrides(text, os.environ)
    if not overrides:
        raise ConfigError(f"--from-verl: no key=value override found in {given!r}")
    return convert(overrides)


def localize(conv: Conversion, out: Path, model: str | None, data: str | None) -> None:
    """The paths as the file at ``out`` reads them (relative to its folder when inside it;
    the source's relative paths were from the working folder), ``--model`` and ``--data``
    in place of the converted ones, and an evaluation folder's files of its split."""
    from streamrft.app.init import _relative

    if model:
        conv.set("model.path", model, "--model")
        conv.set("model.source", "path", "--model")
    if data:
        if conv.fields.get("eval.path") == conv.fields.get("taskset.path"):  # the same set
            conv.set("eval.path", data, "--data, the training set's path too in the source")
        conv.fields.pop("taskset.sources", None)
        conv.set("taskset.path", data, "--data")
    _eval_split(conv)
    for target in PATH_FIELDS:
        value = conv.fields.get(target)
        if isinstance(value, str) and value:
            _hub(conv, target, os.path.expanduser(value))
            conv.fields[target] = _relative(os.path.expanduser(value), out)
    for source in conv.fields.get("taskset.sources", []):
        if source.get("path"):
            source["path"] = _relative(os.path.expanduser(str(source["path"])), out)


def _hub(conv: Conversion, target: str, path: str) -> None:
    """A path that is not here and reads as a hub repository: say to download it (streamrft
    reads local files only)."""
    repo = hub_name(path)
    if repo is None or os.path.exists(path):
        return
    kind = "" if target == "model.path" else " --repo-type dataset"
    conv.reasons[target].append(
        f"no such path here, and {repo} reads as a hub repository: streamrft reads local "
        f"files only, so download it (huggingface-cli download {repo}{kind} --local-dir "
        f"{repo}) or point this at your copy"
    )
    conv.note(f"{target}: download {repo} first (huggingface-cli download{kind})")


def _eval_split(conv: Conversion) -> None:
    """``eval.path`` a folder of a hub's layout: its one file of the evaluation split
    (``eval.path`` is read with ``taskset.split``, the training split)."""
    from streamrft.infra.data_files import is_saved_dataset, split_files

    folder = Path(str(conv.fields.get("eval.path", "")))
    if not (conv.eval_split and folder.is_dir()) or is_saved_dataset(folder):
        return
    try:
        files = split_files(folder, conv.eval_split)
    except ConfigError as exc:
        conv.note(f"eval.path: {exc}")
        return
    if len(files) == 1:
        conv.set("eval.path", str(files[0]), f"the folder's one file of `{conv.eval_split}`")
    else:
        conv.note(f"eval.path: name one of the {len(files)} files of {conv.eval_split}")


def add_from_arguments(sp: argparse.ArgumentParser) -> None:
    """``--from-trinity`` and ``--from-verl`` on ``init``'s parser ``sp``, whose command
    becomes :func:`cmd_init_from` (``init`` itself without them)."""
    source = sp.add_mutually_exclusive_group()
    source.add_argument(
        "--from-trinity",
        metavar="FILE",
        help="convert a Trinity-RFT config (YAML) instead of asking; --model and --data "
        "replace its model and task paths",
    )
    source.add_argument(
        "--from-verl",
        metavar="OVERRIDES|FILE",
        help="convert a verl command line instead of asking: 'key=value ...', or a file of "
        "them (one a line, or the shell script that runs verl.trainer.main_ppo)",
    )
    sp.set_defaults(func=cmd_init_from)


def cmd_init_from(args: argparse.Namespace) -> int:
    from streamrft.app.init import cmd_init

    if not (args.from_trinity or args.from_verl):
        return cmd_init(args)
    if args.override:
        raise ConfigError(
            "-o: not with --from-trinity or --from-verl (their values come from the source); "
            "edit the file written, or give -o to validate and run"
        )
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"--out: {out} exists; give another file or --force")
    return init_from(args, out)


def init_from(args: argparse.Namespace, out: Path) -> int:
    """Convert, write ``out``, check it (0: every check passed, 1: one failed)."""
    from streamrft.app.init import _resolved, render
    from streamrft.app.process import setup_logging
    from streamrft.app.validate import validate
    from streamrft.infra.config import load_config

    setup_logging("WARNING")
    if args.from_trinity:
        conv, source = read_trinity(Path(args.from_trinity)), args.from_trinity
    else:
        given = Path(args.from_verl)
        shown_as = str(given) if "=" not in args.from_verl and given.is_file() else "a command line"
        conv, source = read_verl(args.from_verl), shown_as
    localize(conv, out, args.model, args.data)
    tree = conv.tree()
    base = Path(os.path.abspath(out)).parent
    cfg = from_dict(_resolved(tree, base))  # a mistake stops here, before anything is written
    header, *rest = render(tree, cfg, False, conv.reason_text()).splitlines()
    said = f"# Converted from {conv.source} ({source}): each field says where its value came from."
    text = "\n".join([header, said, *rest, *comment_block(conv)]) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    _print(conv)
    print(f"written: {out}")
    checks = validate(load_config(out, check_files=False), False)
    for c in checks:
        print(f"{c.name:<13} {'ok' if c.ok else 'FAILED'}: {c.detail}")
        for w in c.warnings:
            print(f"{'warning':<13} {w}")
    return 1 if any(not c.ok for c in checks) else 0


def _print(conv: Conversion) -> None:
    print(f"converted from {conv.source}:")
    for target, value in conv.fields.items():
        print(f"  {target} = {shown(value)}")
        print(f"      {'; '.join(conv.reasons.get(target, []))}")
    if conv.unmapped:
        print(f"no counterpart ({len(conv.unmapped)}), not converted:")
        for key, why in conv.unmapped.items():
            print(f"  {key}: {why}")
    for note in conv.notes:
        print(f"note: {note}")
