"""Serve mode's pure parts: the recorder's groups and the response bodies' stop strings."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.infra.modeling import build_char_tokenizer
from streamrft.producers.engines.base import Rollout
from streamrft.producers.serving.batcher import Batcher, Sampling
from streamrft.producers.serving.completions import finish, response_body
from streamrft.producers.serving.recorder import Full, Recorder, UnknownResponse
from streamrft.schemas.arrays import unpack_f32, unpack_i32
from streamrft.schemas.experience import validate_group

TOK = build_char_tokenizer()


def _rollout(prompt: str, response: str, eos: bool = False) -> Rollout:
    ids = TOK(response, add_special_tokens=False).input_ids + ([TOK.eos_token_id] if eos else [])
    return Rollout(
        prompt_ids=TOK(prompt).input_ids,
        response_ids=ids,
        logprobs=[-0.1 * (i + 1) for i in range(len(ids))],
        text=response,
    )


def test_a_request_is_a_group_of_its_choices_rewarded_one_by_one():
    rec = Recorder("run", "serve-1", group_size=0, max_recorded=100)
    rec.record("r1", [_rollout("1+1=", "2"), _rollout("1+1=", "3")], 4, 1.0, None, now=0.0)
    assert rec.feedback(1.0, response_id="r1", choice=0) == 1
    assert rec.ready(now=1.0, timeout_s=0, ttl_s=100) == []  # no size, no timeout: waits
    (group,) = rec.commit(2.0, response_id="r1")
    validate_group(group)
    assert group.model_version == 4 and group.created_at == 2.0
    assert [e.reward for e in group.experiences] == [1.0]  # only the rewarded choice
    exp = group.experiences[0]
    assert (
        unpack_i32(exp.tokens)[exp.prompt_length :] == TOK("2", add_special_tokens=False).input_ids
    )
    assert unpack_f32(exp.logprobs) == pytest.approx([-0.1])
    assert rec.held == 1  # choice 1 still waits for a reward
    rec.feedback(0.0, response_id="r1", choice=1)
    (second,) = rec.commit(3.0)
    assert second.id != group.id and rec.held == 0 and not rec.groups
    with pytest.raises(UnknownResponse):
        rec.feedback(1.0, response_id="r1")


def test_a_conversation_groups_its_requests_splits_by_version_and_closes_at_group_size():
    rec = Recorder("run", "serve-1", group_size=3, max_recorded=100)
    rec.record("a", [_rollout("1+1=", "2")], 0, 1.0, "conv", now=0.0)
    rec.record("b", [_rollout("2+2=", "4")], 0, 1.0, "conv", now=1.0)
    rec.record("c", [_rollout("3+3=", "6")], 1, 1.0, "conv", now=2.0)  # a new version came
    assert rec.feedback(0.5, conversation="conv") == 3
    groups = rec.ready(now=2.0, timeout_s=0, ttl_s=100)
    assert [(g.model_version, len(g.experiences)) for g in groups] == [(0, 2), (1, 1)]
    assert all(e.reward == 0.5 for g in groups for e in g.experiences)
    assert len({g.task_id for g in groups}) == 2 and rec.held == 0


def test_timeout_publishes_rewarded_groups_and_ttl_drops_unrewarded_responses():
    rec = Recorder("run", "s", group_size=0, max_recorded=100)
    rec.record("a", [_rollout("1+1=", "2")], 0, 1.0, None, now=0.0)
    rec.record("b", [_rollout("1+1=", "2")], 0, 1.0, None, now=0.0)
    rec.feedback(1.0, response_id="a")
    assert rec.ready(now=5.0, timeout_s=10, ttl_s=100) == []
    (due,) = rec.ready(now=10.0, timeout_s=10, ttl_s=100)
    assert due.experiences[0].reward == 1.0
    assert rec.ready(now=99.0, timeout_s=10, ttl_s=100) == [] and rec.held == 1
    rec.ready(now=100.0, timeout_s=10, ttl_s=100)
    assert rec.held == 0 and rec.expired == 1 and not rec.group_of


def test_the_recorder_refuses_beyond_its_bound_and_unknown_ids():
    rec = Recorder("run", "s", group_size=0, max_recorded=2)
    rec.record("a", [_rollout("1", "2"), _rollout("1", "3")], 0, 1.0, None, now=0.0)
    with pytest.raises(Full):
        rec.record("b", [_rollout("1", "2")], 0, 1.0, None, now=0.0)
    for call in (
        lambda: rec.feedback(1.0, response_id="zzz"),
        lambda: rec.feedback(1.0, conversation="zzz"),
        lambda: rec.feedback(1.0, response_id="a", choice=5),
        lambda: rec.feedback(1.0),
        lambda: rec.commit(0.0, conversation="zzz"),
    ):
        with pytest.raises(UnknownResponse):
            call()


def test_a_stop_string_cuts_the_text_before_it_and_the_tokens_after_it():
    rollout = _rollout("q", "12+34=5")
    choice = finish(rollout, TOK, ["+3"], max_tokens=16)
    assert choice.finish_reason == "stop"
    assert choice.rollout.text == "12"
    assert TOK.decode(choice.rollout.response_ids) == "12+3"  # the tokens that made "+3"
    assert choice.rollout.logprobs == rollout.logprobs[:4]
    assert finish(_rollout("q", "123"), TOK, ["x"], max_tokens=3).finish_reason == "length"
    assert finish(_rollout("q", "12", eos=True), TOK, [], max_tokens=3).finish_reason == "stop"


def test_response_bodies_carry_logprobs_usage_and_the_version():
    choices = [finish(_rollout("1+1=", "2", eos=True), TOK, [], 4)]
    prompt = TOK("1+1=").input_ids
    chat = response_body(True, "chatcmpl-x", "m", 0, 7, prompt, choices, TOK, True)
    assert chat["model_version"] == 7 and chat["choices"][0]["message"]["content"] == "2"
    assert [t["logprob"] for t in chat["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2]
    assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    text = response_body(False, "cmpl-x", "m", 0, 7, prompt, choices, TOK, True)
    assert text["choices"][0]["text"] == "2"
    assert text["choices"][0]["logprobs"]["token_logprobs"] == [-0.1, -0.2]
    assert text["choices"][0]["logprobs"]["text_offset"] == [0, 1]


def test_the_batcher_coalesces_requests_with_the_same_settings_into_one_call():
    calls = []

    async def call(prompts, sampling, seed):
        calls.append((len(prompts), sampling))
        await asyncio.sleep(0.01)
        return [[_rollout("p", str(p[0]))] * sampling.n for p in prompts], len(calls)

    plain, nucleus = Sampling(1, 1.0, 4), Sampling(1, 1.0, 4, top_p=0.9)
    other_n = Sampling(2, 0.5, 4)

    async def main():
        batcher = Batcher(call, max_batch=3)
        first = asyncio.create_task(batcher.sample([9], plain, 0))  # alone: runs at once
        await asyncio.sleep(0)
        rest = [batcher.sample([i], plain, 0) for i in range(4)]
        truncated = batcher.sample([8], nucleus, 0)
        other = batcher.sample([7], other_n, 0)
        out = await asyncio.gather(first, *rest, truncated, other)
        await batcher.close()
        return out

    out = asyncio.run(main())
    assert calls == [(1, plain), (3, plain), (1, plain), (1, nucleus), (1, other_n)]
    assert [o[0][0].text for o in out] == ["9", "0", "1", "2", "3", "8", "7"]
    assert [o[1] for o in out] == [1, 2, 2, 2, 3, 4, 5]  # the version of the call that sampled


class _WorkerDeath(BaseException):
    """What ``except Exception`` does not catch."""


def test_a_dead_batcher_fails_its_requests_and_the_next_request_starts_a_new_one():
    from streamrft.schemas import ServiceError

    calls = []

    async def call(prompts, sampling, seed):
        calls.append(len(prompts))
        if len(calls) == 1:
            await asyncio.sleep(0.01)
            raise _WorkerDeath
        return [[_rollout("p", "ok")] * sampling.n for _ in prompts], 5

    async def main():
        batcher = Batcher(call, max_batch=1)
        first = asyncio.create_task(batcher.sample([1], Sampling(1, 1.0, 4), 0))
        await asyncio.sleep(0)
        queued = asyncio.create_task(batcher.sample([2], Sampling(1, 1.0, 4), 0))
        results = await asyncio.wait_for(
            asyncio.gather(first, queued, return_exceptions=True), 5
        )  # before: both waited for ever
        again = await asyncio.wait_for(batcher.sample([3], Sampling(1, 1.0, 4), 0), 5)
        await batcher.close()
        return results, again

    (first, queued), again = asyncio.run(main())
    assert isinstance(first, ServiceError) and "the request batcher failed" in str(first)
    assert isinstance(queued, ServiceError)
    assert again[0][0].text == "ok" and again[1] == 5


def test_a_big_conversation_is_published_in_parts_under_the_byte_budget():
    rec = Recorder("run", "s", group_size=0, max_recorded=10_000, max_group_bytes=2_000)
    for i in range(10):
        rec.record(f"r{i}", [_rollout("1+1=", "2" * 40)], 0, 1.0, "conv", now=0.0)
    rec.feedback(1.0, conversation="conv")
    groups = rec.commit(1.0)
    sizes = [len(g.experiences) for g in groups]
    assert sum(sizes) == 10 and len(groups) > 1 and len({g.id for g in groups}) == len(groups)
    for g in groups:
        validate_group(g)
        assert sum(len(e.tokens) + len(e.logprobs) for e in g.experiences) <= 2_000
