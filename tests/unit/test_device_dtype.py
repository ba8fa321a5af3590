"""``model.dtype`` casts parameters only: the rotary embedding's frequencies stay float32,
as in the trainer's float32 master model, so a bf16 explorer encodes positions alike."""

from __future__ import annotations

import pytest
import torch

from streamrft.infra.config import ModelConfig
from streamrft.infra.modeling import load_policy

pytestmark = [pytest.mark.unit, pytest.mark.numeric]


def test_bf16_parameters_keep_float32_rotary_frequencies():
    model, _ = load_policy(ModelConfig(dtype="bfloat16", max_positions=64))
    master, _ = load_policy(ModelConfig(dtype="bfloat16", max_positions=64), dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    buffers = dict(model.named_buffers())
    assert buffers and {b.dtype for b in buffers.values()} == {torch.float32}
    for name, b in master.named_buffers():
        assert torch.equal(buffers[name], b), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
