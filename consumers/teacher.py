"""The teacher of on-policy distillation (``algorithm.teacher_path``): a Hugging Face model
folder loaded once by the train engine, frozen, and checked against the policy's tokenizer.

The student's samples are scored by the teacher token by token (the ``distill`` advantage,
:mod:`.algorithms.advantages`), so both must read token ids alike: the teacher's tokenizer
must map every token to the policy's id, and its embedding must cover them (it may have
more rows: models of one family often pad their embeddings to different sizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import load_policy
from streamrft.schemas.errors import ConfigError


def load_teacher(
    path: str, tokenizer: Any, model: ModelConfig, dtype: torch.dtype
) -> torch.nn.Module:
    """The model in the folder ``path``, on ``model.device`` with its parameters in
    ``dtype`` (the trainer's compute dtype), in eval mode with no parameter trained.

    A missing folder, one without a model or that does not load, or a vocabulary other than ``tokenizer``'s
    is a :class:`ConfigError` naming ``algorithm.teacher_path``."""
    if not Path(path).is_dir():
        raise ConfigError(f"algorithm.teacher_path: folder {path!r} does not exist")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"algorithm.teacher_path: {path!r} has no config.json: not a Hugging Face model folder"
        )
    where = ModelConfig(source="path", path=path, device=model.device, dtype=model.dtype)
    try:
        teacher, teacher_tokenizer = load_policy(where, dtype=dtype)
    except ConfigError as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(f"algorithm.teacher_path: cannot load {path!r}: {cause}") from exc
    check_vocabulary(teacher, teacher_tokenizer, tokenizer)
    teacher.requires_grad_(False)
    return teacher.eval()


def check_vocabulary(teacher: torch.nn.Module, teacher_tokenizer: Any, tokenizer: Any) -> None:
    """A :class:`ConfigError` naming both sizes unless the teacher's tokenizer maps every
    token as ``tokenizer`` does and its embedding has a row for each."""
    ours, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    rows = teacher.get_input_embeddings().num_embeddings
    if theirs != ours:
        raise ConfigError(
            f"algorithm.teacher_path: the teacher's vocabulary ({len(theirs)} tokens) differs "
            f"from the policy's ({len(ours)} tokens); distillation needs the policy's tokenizer"
        )
    if rows < len(ours):
        raise ConfigError(
            f"algorithm.teacher_path: the teacher's embedding has {rows} rows, fewer than the "
            f"policy's vocabulary of {len(ours)} tokens"
        )
