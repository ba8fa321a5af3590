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


def write_eos_steered_folder(folder: Path, ends: bool, positions: int = 64) -> Path:
    """The tiny Llama of :func:`write_tiny_folder` (``positions`` of context) made to end at
    once (``ends``) or never: every token's embedding carries +2 in its first dimension and
    the EOS's +6 (``ends``) or -2, so after the final norm, whatever the other dimensions
    hold, the EOS's logit stands ~30 above (or below) every other token's. Saved to
    ``folder``; returns it."""
    import torch

    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model, save_policy

    cfg = ModelConfig(max_positions=positions)
    tokenizer = build_char_tokenizer(cfg.charset)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(cfg, tokenizer)
    with torch.no_grad():  # tied: the same rows are the output layer's
        rows = model.get_input_embeddings().weight
        rows[:, 0] = 2.0
        rows[tokenizer.eos_token_id, 0] = 6.0 if ends else -2.0
    return save_policy(model, tokenizer, folder)
