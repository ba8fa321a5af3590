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
    from streamrft.infra.modeling import save_policy

    return save_policy(*_tiny_llama(ModelConfig()), folder)


def write_eos_steered_folder(folder: Path, ends: bool, positions: int = 64) -> Path:
    """The tiny Llama of :func:`write_tiny_folder` (``positions`` of context) made to end at
    once (``ends``) or never: every token's embedding carries +2 in its first dimension and
    the EOS's +6 (``ends``) or -2, so after the final norm, whatever the other dimensions
    hold, the EOS's logit stands ~30 above (or below) every other token's. Saved to
    ``folder``; returns it."""
    import torch

    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import save_policy

    model, tokenizer = _tiny_llama(ModelConfig(max_positions=positions))
    with torch.no_grad():  # tied: the same rows are the output layer's
        rows = model.get_input_embeddings().weight
        rows[:, 0] = 2.0
        rows[tokenizer.eos_token_id, 0] = 6.0 if ends else -2.0
    return save_policy(model, tokenizer, folder)


DRIFT_CHARACTERS = 20_000
"""Characters the drifting model's vocabulary adds (CJK ideographs): a long tail of tokens,
as a real model's vocabulary is (SmolLM2's holds 49,152)."""
DRIFT_GAP = 4.5
"""How far the drifting model's EOS logit stands above each other token's."""


def write_drifting_folder(folder: Path, positions: int = 320) -> Path:
    """A model that drifts on at temperature 1.0 and ends its answers at 0.7, as
    SmolLM2-135M-Instruct does on GSM8K: the tiny Llama of :func:`write_tiny_folder`
    (``positions`` of context) with :data:`DRIFT_CHARACTERS` more characters, every layer's
    output zeroed and every embedding ``(2, 0, ...)`` but the EOS's ``(2 + gap / 8, 0,
    ...)``. At each step, whatever came before, the EOS's logit then stands
    :data:`DRIFT_GAP` above each of the other 20,077 tokens' (the final norm makes the
    first dimension 8, less millionths for its epsilon), and a step ends with probability
    ``1 / (1 + 20077 exp(-4.5 / T))`` at temperature T: 0.45% at 1.0, 3.0% at 0.7. Over
    the 299 steps that 320 positions leave after the GSM8K-shaped prompts
    (:mod:`tests.helpers.gsm8k_shape`), 26% of the responses run to the cap at 1.0, 0.01%
    at 0.7.

    With ``init``'s seeds (response ``i`` by seed ``i``, 0 to 7) the draws are fixed: the
    engine's sampler picks ``argmax(p / q)`` of exponential draws ``q``, so a response runs
    to the cap at temperature T where the gap is below T times the least, over its steps,
    of ``log q_eos - min(log q_other)``. Those least values are 2.51, 0.78, 4.43, 5.15,
    4.23, 0.98, 4.64, 5.40 (torch 2.13, x86 CPU, 2026-12-06): any gap from 3.78 to 5.40
    gives a response run to the cap at 1.0 and none at 0.7, and 4.5 is 0.7 or more inside
    either end, where float rounding moves a logit by millionths. At 4.5, three responses
    (seeds 3, 6, 7) run to the cap at 1.0, and the longest at 0.7 ends after 100 tokens.
    Saved to ``folder``; returns it."""
    import torch

    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import DEFAULT_CHARSET, save_policy

    extra = "".join(chr(0x4E00 + i) for i in range(DRIFT_CHARACTERS))
    model, tokenizer = _tiny_llama(
        ModelConfig(max_positions=positions, charset=DEFAULT_CHARSET + extra)
    )
    with torch.no_grad():  # tied: the same rows are the output layer's
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        rows = model.get_input_embeddings().weight
        rows.zero_()
        rows[:, 0] = 2.0
        rows[tokenizer.eos_token_id, 0] = 2.0 + DRIFT_GAP / 8
    return save_policy(model, tokenizer, folder)


def _tiny_llama(cfg):
    """The tiny Llama of model config ``cfg`` and its character tokenizer, with
    :data:`CHAT_TEMPLATE`: (model, tokenizer)."""
    from streamrft.infra.modeling import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(cfg.charset)
    tokenizer.chat_template = CHAT_TEMPLATE
    return build_tiny_model(cfg, tokenizer), tokenizer
