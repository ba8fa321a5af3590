"""Serve limits are checked before the engine runs, and bound tokens, not only responses:
a full server answers 503 without sampling (at 41ac149 a refused request still made an
engine call). Through the real HTTP API of an explorer's recording endpoint."""

from __future__ import annotations

import openai
import pytest

from streamrft.schemas.arrays import unpack_f32
from tests.helpers.endpoints import client_of, tiny_endpoint
from tests.helpers.probes import check

pytestmark = pytest.mark.integration


@pytest.fixture
def endpoint():
    ep = tiny_endpoint("limits-run", version=0, max_tokens=4)
    calls = []
    real = ep.engine.rollout

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    ep.engine.rollout = counted
    ep.calls = calls
    yield ep
    ep.stop()


_client = client_of


def test_a_full_server_refuses_before_sampling(endpoint):
    endpoint.recorder.max_recorded = 2
    client = _client(endpoint, "c1")
    client.completions.create(model="policy", prompt="1+1=", max_tokens=2, n=2)
    assert len(endpoint.calls) == 1 and endpoint.recorder.held == 2
    with pytest.raises(openai.InternalServerError, match=r"serve\.max_recorded=2"):
        client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
    assert len(endpoint.calls) == 1  # the engine never ran for the refused request


def test_tokens_bound_what_is_held(endpoint):
    endpoint.recorder.max_tokens = 40
    client = _client(endpoint, "c2")
    client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
    held = endpoint.recorder.held_tokens
    assert 0 < held <= 8  # a prompt of 4 characters and BOS, 2 tokens sampled
    with pytest.raises(openai.InternalServerError, match=r"serve\.max_recorded_tokens=40"):
        client.completions.create(model="policy", prompt="12+34=", max_tokens=4, n=8)
    assert len(endpoint.calls) == 1 and endpoint.recorder.held_tokens == held
    endpoint.collect("c2", 1.0)  # the episode taken: its tokens are released
    assert endpoint.recorder.held_tokens == 0


def test_an_abandoned_episodes_responses_expire(endpoint):
    client = _client(endpoint, "stuck")
    client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
    assert endpoint.recorder.held == 1
    assert endpoint.recorder.expire(now=1e12, ttl_s=3600.0) == 1  # far in the future
    assert endpoint.recorder.held == 0 and endpoint.recorder.held_tokens == 0


def test_the_fields_agents_send_are_honoured_accepted_or_named(endpoint):
    """``seed``, ``user`` and ``max_completion_tokens`` are honoured; OpenAI's fields that
    change nothing here are accepted silently; any other field is accepted and named in
    ``/health`` (counted, logged once)."""
    client = _client(endpoint, "c4")
    asked = {"model": "policy", "messages": [{"role": "user", "content": "1+2="}]}
    same = [
        client.chat.completions.create(
            **asked, seed=7, user="u1", max_completion_tokens=3, temperature=1.0,
            metadata={"session": "s"}, store=False,
            extra_body={"stream_options": None, "framework_trace_id": "t"},
        )
        for _ in range(2)
    ]  # fmt: skip
    assert same[0].choices[0].message.content == same[1].choices[0].message.content
    assert same[0].usage.completion_tokens <= 3
    client.completions.create(model="policy", prompt="2+2=", max_tokens=2, extra_body={"x": 1})
    status, health = check(endpoint.base_url("c4").removesuffix("/v1"), "/health")
    assert status == 200
    assert health["unknown_fields"] == {"framework_trace_id": 2, "x": 1}


def test_top_p_and_top_k_are_served_when_the_trainer_corrects_for_them(endpoint):
    """Refused while the run has no off-policy correction; with one, sampled from the
    truncated distribution, whose log-probs are the ones returned and recorded (top_k=1:
    the argmax, each token certain)."""
    client = _client(endpoint, "c5")
    asked = {"model": "policy", "messages": [{"role": "user", "content": "1+2="}]}
    with pytest.raises(openai.BadRequestError, match="set an off-policy correction"):
        client.chat.completions.create(**asked, top_p=0.5)
    assert endpoint.calls == []
    endpoint.prepare(version=0, temperature=1.0, max_tokens=4, corrected=True)
    out = client.chat.completions.create(
        **asked, logprobs=True, max_tokens=4, extra_body={"top_k": 1}
    )
    returned = [t.logprob for t in out.choices[0].logprobs.content]
    assert returned == [0.0] * len(returned)
    nucleus = client.chat.completions.create(**asked, logprobs=True, max_tokens=4, top_p=0.5)
    sent = [t.logprob for t in nucleus.choices[0].logprobs.content]
    (first, second) = endpoint.collect("c5", 1.0)
    assert unpack_f32(first.logprobs) == returned
    assert unpack_f32(second.logprobs) == pytest.approx(sent, abs=1e-6)
    assert all(lp <= 0 for lp in sent)
