"""The delta encoding's guards and fixed points, each a mutant of sync/delta.py that the
other tests let live (../shared/reviews/mutation-2026-11.md): a malformed delta is an
IntegrityError that leaves the base as it was, every kind of tensor change round-trips,
the wire format of the mask is pinned, and the state digest depends on exactly the
names, dtypes, shapes and bytes."""

from __future__ import annotations

import pytest
import torch

from streamrft.schemas import IntegrityError
from streamrft.sync import delta
from streamrft.sync.delta import IDX, MASK, VAL

pytestmark = pytest.mark.unit


def _base() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16, dtype=torch.float32)}


def _fails(changes: dict[str, torch.Tensor], match: str) -> None:
    base = _base()
    before = base["w"].clone()
    with pytest.raises(IntegrityError, match=match):
        delta.decode(changes, base)
    assert torch.equal(base["w"], before)  # never written


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"w" + IDX: torch.tensor([-1], dtype=torch.int32), "w" + VAL: torch.ones(1)}, "#idx"),
        ({"w" + IDX: torch.tensor([16], dtype=torch.int32), "w" + VAL: torch.ones(1)}, "#idx"),
        ({"w" + IDX: torch.tensor([1, 2, 3], dtype=torch.int32), "w" + VAL: torch.ones(1)}, "#idx"),
        ({"w" + IDX: torch.tensor([1, 2, 3], dtype=torch.int32), "w" + VAL: torch.ones(2)}, "#idx"),
        (
            {"w" + IDX: torch.tensor([1], dtype=torch.int32), "w" + VAL: torch.ones(1).double()},
            "#val",
        ),
        (
            {
                "w" + IDX: torch.tensor([1], dtype=torch.int32),
                "w" + MASK: delta.pack_mask(torch.arange(16) == 1),
                "w" + VAL: torch.ones(1),
            },
            "incomplete",
        ),
        # a mask one byte too long / too short whose count of ones still matches the values
        (
            {"w" + MASK: torch.tensor([1, 0, 0], dtype=torch.uint8), "w" + VAL: torch.ones(1)},
            "#mask",
        ),
        ({"w" + MASK: torch.tensor([1], dtype=torch.uint8), "w" + VAL: torch.ones(1)}, "#mask"),
        # a mask of the right size with too many or too few values
        (
            {"w" + MASK: delta.pack_mask(torch.arange(16) < 2), "w" + VAL: torch.ones(1)},
            "#mask",
        ),
        (
            {"w" + MASK: delta.pack_mask(torch.arange(16) < 2), "w" + VAL: torch.ones(3)},
            "#mask",
        ),
    ],
)
def test_a_malformed_delta_is_refused_and_the_base_untouched(changes, match):
    _fails(changes, match)


def _round_trip(base: dict, new: dict) -> dict:
    changes = delta.encode(new, base)
    rebuilt = delta.decode(changes, base)
    assert set(rebuilt) == set(new)
    for name, tensor in new.items():
        assert rebuilt[name].dtype == tensor.dtype and rebuilt[name].shape == tensor.shape, name
        assert torch.equal(
            rebuilt[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)
        )
    return changes


def test_a_tensor_new_since_the_base_goes_whole():
    base = _base()
    new = {**base, "added": torch.ones(3)}
    assert set(_round_trip(base, new)) == {"added"}


def test_a_reshaped_or_retyped_tensor_goes_whole():
    base = {"w": torch.arange(16, dtype=torch.bfloat16)}
    reshaped = {"w": base["w"].reshape(4, 4)}
    assert set(_round_trip(base, reshaped)) == {"w"}
    retyped = {"w": base["w"].view(torch.float16)}  # the same bits, another dtype
    assert set(_round_trip(base, retyped)) == {"w"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8])
def test_a_one_or_eight_byte_tensor_with_few_changes_is_a_delta_with_int32_indices(dtype):
    base = {"w": torch.zeros(1000, dtype=dtype)}
    new = {"w": base["w"].clone()}
    new["w"][[3, 500]] = 7
    changes = _round_trip(base, new)
    assert set(changes) == {"w" + IDX, "w" + VAL}
    assert changes["w" + IDX].dtype == torch.int32 and changes["w" + IDX].tolist() == [3, 500]


def test_the_cheaper_encoding_counts_the_values_too():
    # 6 of 64 float32 changed: indices 6 x (4 + 4) = 48 bytes, a mask 8 + 6 x 4 = 32 bytes
    base = {"w": torch.zeros(64)}
    new = {"w": base["w"].clone()}
    new["w"][:6] = 1
    assert set(delta.encode(new, base)) == {"w" + MASK, "w" + VAL}


def test_the_mask_is_little_endian_within_each_byte():
    changed = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert delta.pack_mask(changed).tolist() == [1, 1]
    assert delta.pack_mask(torch.arange(8) == 7).tolist() == [128]


def test_the_state_digest_ignores_order_and_sees_dtype_and_shape():
    a = {"x": torch.arange(4, dtype=torch.float32), "y": torch.ones(2, 2)}
    b = {"y": a["y"], "x": a["x"]}
    assert delta.state_sha256(a) == delta.state_sha256(b)
    as_int = {**a, "x": a["x"].view(torch.int32)}  # the same bytes
    reshaped = {**a, "x": a["x"].reshape(2, 2)}
    assert delta.state_sha256(as_int) != delta.state_sha256(a)
    assert delta.state_sha256(reshaped) != delta.state_sha256(a)
