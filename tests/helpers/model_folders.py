"""Model folders made in a test: the tiny Llama the tests train, saved as a Hugging Face
folder with a chat template (weights, config.json, tokenizer), for the commands that read a
real folder (``init``, ``validate``, ``plan``, ``run`` with ``model.source: path``)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.qwen_shape import CHAT_TEMPLATE


def write_tiny_folder(folder: Path) -> Path:
    """The tiny Llama (``ModelConfig``'s defaults: 2 layers of 64, 64 positions) and its
    character tokenizer with :data:`CHAT_TEMPLATE`, saved to ``folder``; returns it."""
    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model, save_policy

    cfg = ModelConfig()
    tokenizer = build_char_tokenizer(cfg.charset)
    tokenizer.chat_template = CHAT_TEMPLATE
    return save_policy(build_tiny_model(cfg, tokenizer), tokenizer, folder)
