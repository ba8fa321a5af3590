"""The decoded samples an explorer shows (``producers/samples.py``) and their wire type."""

from __future__ import annotations

import msgspec
import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.producers.samples import cut, parts_of, pick_samples, sample_records
from streamrft.schemas import Segment
from streamrft.schemas.arrays import pack_f32, pack_i32, pack_u8
from streamrft.schemas.codec import SAMPLE
from streamrft.schemas.errors import SchemaError
from streamrft.schemas.experience import Experience, ExperienceGroup
from streamrft.schemas.samples import MAX_SAMPLE_TEXT, Sample, SamplePart, validate_sample
from tests.helpers.scripted import CHARSET

pytestmark = pytest.mark.unit


def _episode(tok) -> Experience:
    """``3+4=`` then a call, the tool's result (inserted), the answer."""
    ids = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    prompt, call, result, answer = ids("3+4="), ids("<tool>add</tool>"), ids(" 7 "), ids("7")
    response = [*call, *result, *answer]
    mask = [1] * len(call) + [0] * len(result) + [1] * len(answer)
    return Experience(
        id="r/t@0#0",
        tokens=pack_i32(prompt + response),
        prompt_length=len(prompt),
        logprobs=pack_f32([-0.5 if m else 0.0 for m in mask]),
        action_mask=pack_u8(mask),
        reward=1.0,
        model_version=2,
        segments=[Segment(start=0, version=2), Segment(start=len(call) + len(result), version=3)],
        info={"turns": 2.0},
    )


def test_a_conversation_is_cut_where_the_mask_changes():
    tok = build_char_tokenizer(CHARSET)
    parts = parts_of(_episode(tok), tok)
    assert [(p.role, p.text.replace(" ", "")) for p in parts] == [
        ("prompt", "3+4="),
        ("policy", "<tool>add</tool>"),
        ("inserted", "7"),
        ("policy", "7"),
    ]


def test_picked_samples_carry_the_rollout_and_go_on_the_wire():
    tok = build_char_tokenizer(CHARSET)
    exp = _episode(tok)
    groups = [
        ExperienceGroup(
            id=f"r/t{i}@0", run="r", task_id=f"t{i}", explorer="explorer-0", model_version=2,
            experiences=[msgspec.structs.replace(exp, id=f"r/t{i}@0#0")], workflow="tool_calling",
            explorer_step=5,
        )
        for i in range(5)
    ]  # fmt: skip
    samples = pick_samples(groups, 2, tok, seed=1)
    assert len(samples) == 2 and len({s.task_id for s in samples}) == 2  # two groups
    again = pick_samples(groups, 2, tok, seed=1)
    assert [x.experience_id for x in again] == [x.experience_id for x in samples]  # seeded
    s = samples[0]
    assert (s.explorer, s.explorer_step, s.workflow) == ("explorer-0", 5, "tool_calling")
    assert s.reward == 1.0 and s.model_version == 2 and s.versions == [2, 3]
    assert s.info == {"turns": 2.0}
    (record, _) = sample_records("p.r.samples", samples)
    assert record.key == s.task_id.encode()
    assert SAMPLE.decode(record.value, list(record.headers)) == s
    assert len(pick_samples(groups, 9, tok, seed=1)) == 5  # no more than the groups


def test_long_text_is_cut_and_says_so():
    text = "x" * (MAX_SAMPLE_TEXT + 50)
    assert cut(text) == "x" * MAX_SAMPLE_TEXT + " [... 50 more characters]"
    assert cut("short") == "short"


def _sample(**changes) -> Sample:
    base = Sample(
        experience_id="e", task_id="t", explorer="x", explorer_step=0, workflow="math",
        model_version=0, reward=0.0, parts=[SamplePart(role="prompt", text="p")],
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"parts": [SamplePart(role="<b>", text="")]}, "role '<b>' not in"),
        ({"parts": [SamplePart(role="policy", text="x" * 5000)]}, "5000 characters"),
        ({"parts": [SamplePart(role="policy", text="")] * 65}, "65 parts, over 64"),
        ({"reward": float("nan")}, "not finite"),
        ({"task_id": ""}, "task_id"),
    ],
)
def test_a_sample_that_breaks_a_rule_is_refused(changes, message):
    with pytest.raises(SchemaError, match=message):
        validate_sample(_sample(**changes))
