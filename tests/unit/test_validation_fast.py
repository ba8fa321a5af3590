"""The C-speed checks of experience validation reject exactly what the per-value rules
reject, with the same error: log-prob ranges (``schemas.experience``, a high-byte test
before the per-value loop) and token ids against the vocabulary (the trainer's intake,
numpy before the schemas' check)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from streamrft.consumers.intake import _check_token_ids
from streamrft.schemas import limits
from streamrft.schemas.arrays import pack_f32, unpack_f32
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import check_token_ids, validate_group
from tests.helpers.groups import make_group


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _next_f32(x: float, towards: float) -> float:
    """The float32 next to ``x`` in the direction of ``towards``."""
    return float(np.nextafter(np.float32(x), np.float32(towards)))


def _reference(logprobs: bytes) -> str | None:
    """The rule as a plain loop over every value: the first one outside the range."""
    for logp in unpack_f32(logprobs):
        if not limits.MIN_LOGPROB <= logp <= limits.MAX_LOGPROB:
            return f"log-prob {logp} outside [{limits.MIN_LOGPROB}, {limits.MAX_LOGPROB}]"
    return None


EDGES = [
    0.0,
    -0.0,
    limits.MIN_LOGPROB,
    _next_f32(limits.MIN_LOGPROB, -1e9),
    _next_f32(limits.MIN_LOGPROB, 0.0),
    _f32(limits.MAX_LOGPROB),
    _next_f32(limits.MAX_LOGPROB, 1.0),
    _next_f32(limits.MAX_LOGPROB, -1.0),
    -32.0,
    _next_f32(-32.0, 0.0),
    _next_f32(-32.0, -1e9),
    2.0**-16,
    _next_f32(2.0**-16, 0.0),
    1e-45,  # the smallest subnormal
    -1e-45,
    float("nan"),
    -float("nan"),
    float("inf"),
    -float("inf"),
    1.0,
    -1e30,
    3.4e38,
]


def _validate_one(logprobs: list[float]) -> str | None:
    """What validate_group says of one experience holding ``logprobs``."""
    n = len(logprobs)
    group = make_group(
        "r",
        "t",
        0,
        n=1,
        tokens=[[1, 2] + [3] * n],
        prompt_length=2,
        logprobs=[logprobs],
        masks=[[1] * n],
    )
    try:
        validate_group(group)
    except SchemaError as exc:
        return str(exc).split(": ", 1)[1]
    return None


@pytest.mark.parametrize("edge", EDGES, ids=repr)
def test_each_edge_value_is_judged_as_the_loop_judges_it(edge):
    for values in ([edge], [-1.0, -0.5, edge], [edge, -2.0, -90.0]):
        assert _validate_one(values) == _reference(pack_f32(values)), values


def test_random_float32_bit_patterns_are_judged_as_the_loop_judges_them():
    rng = np.random.default_rng(7)
    rejected = 0
    for _ in range(400):
        n = int(rng.integers(1, 40))
        bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype("<u4")
        # mostly plausible log-probs, with arbitrary bit patterns mixed in
        plausible = (-rng.exponential(3.0, n)).astype("<f4").view("<u4")
        mixed = np.where(rng.random(n) < 0.1, bits, plausible).astype("<u4")
        values = unpack_f32(mixed.tobytes())
        want = _reference(mixed.tobytes())
        rejected += want is not None
        assert _validate_one(values) == want
    assert 50 < rejected < 400  # both outcomes were exercised


def test_every_high_byte_with_extreme_low_bytes():
    """Each of the 256 high bytes, with the lowest and highest value it can start."""
    for high in range(256):
        for low in (b"\x00\x00\x00", b"\xff\xff\xff", b"\x00\x00\x80", b"\xff\xff\x7f"):
            data = low + bytes([high])
            assert _validate_one(unpack_f32(data)) == _reference(data), data.hex()


def _group_with_tokens(tokens: list[list[int]]):
    return make_group(
        "r",
        "t",
        0,
        n=len(tokens),
        tokens=tokens,
        prompt_length=2,
        logprobs=[[-0.5] * (len(t) - 2) for t in tokens],
        masks=[[1] * (len(t) - 2) for t in tokens],
    )


@pytest.mark.parametrize("vocab", [1, 16, 17, 151_936, (1 << 31) - 1])
def test_intake_token_check_rejects_what_the_schemas_check_rejects(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(30):
        top = int(rng.choice([15, 16, 17, 151_935, 151_936, (1 << 31) - 1]))
        tokens = [
            [int(x) for x in rng.integers(0, top + 1, int(rng.integers(3, 12)))] for _ in range(3)
        ]
        group = _group_with_tokens(tokens)
        try:
            check_token_ids(group, vocab)
            want = None
        except SchemaError as exc:
            want = str(exc)
        try:
            _check_token_ids(group, vocab)
            got = None
        except SchemaError as exc:
            got = str(exc)
        assert got == want


def test_intake_token_check_names_the_first_experience_over_the_vocabulary():
    group = _group_with_tokens([[1, 2, 3], [1, 2, 40], [1, 2, 50]])
    with pytest.raises(SchemaError, match=r"#1'.*token id 40 outside .* vocabulary of 32"):
        _check_token_ids(group, 32)
    _check_token_ids(group, 51)  # all below: no error
