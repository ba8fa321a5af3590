"""``explorer.reward: judge`` over real HTTP: a local server that answers as an
OpenAI-compatible endpoint does (a chat completion), or with errors, or not at all. The
judge against a real ``streamrft serve`` is in ``tests/integration/test_judge_serve.py``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from streamrft.infra.config import RewardConfig
from streamrft.producers.reward_judge import JudgeReward
from streamrft.producers.rewards import get_reward, score_all
from streamrft.schemas import ChatMessage, ConfigError, Task
from streamrft.schemas.errors import RewardServiceError
from tests.helpers.scheduled import scheduled

pytestmark = pytest.mark.unit

TASK = Task(id="t1", prompt="3+4=", answer="7")

Reply = tuple[int, str]  # (HTTP status, body)


def completion(text: str) -> Reply:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
    return 200, json.dumps(body)


class Judge:
    """A local HTTP server: ``answer(request body)`` gives each chat completion's reply;
    it records the requests and the most it held at once."""

    def __init__(self, answer: Callable[[dict], Reply], delay_s: float = 0.0) -> None:
        self.answer, self.delay_s = answer, delay_s
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()


@contextmanager
def serving(judge: Judge) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self._reply(200, json.dumps({"data": [{"id": "judge-model"}]}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with judge.lock:
                judge.requests.append(body)
                judge.headers.append(dict(self.headers))
                judge.in_flight += 1
                judge.most_in_flight = max(judge.most_in_flight, judge.in_flight)
            time.sleep(judge.delay_s)
            with judge.lock:
                judge.in_flight -= 1
            self._reply(*judge.answer(body))

        def _reply(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _judge(url: str, **settings) -> JudgeReward:
    return JudgeReward(RewardConfig(base_url=url, **settings), sleep=lambda s: None)


def test_the_score_over_the_scale_is_the_reward_and_the_rubric_is_sent():
    judge = Judge(lambda body: completion("The answer is right.\nScore: 7"))
    with serving(judge) as url:
        reward = _judge(url, model="j", max_tokens=20, temperature=0.5)
        value, info = reward("It is 7.", TASK)
    assert value == pytest.approx(0.7) and info == {"judge_score": 7.0}
    (sent,) = judge.requests
    assert sent["model"] == "j" and sent["max_tokens"] == 20 and sent["temperature"] == 0.5
    prompt = sent["messages"][0]["content"]
    assert "3+4=" in prompt and "It is 7." in prompt and "from 0 to 10.0" in prompt


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Score: 12", 1.0),  # clipped to the scale
        ("score = -3", 0.0),
        ("Score: 4, no, Score: 8.5", 0.85),  # the last one given
        ("SCORE:10", 1.0),
    ],
)
def test_scores_are_parsed_and_clipped(reply, expected):
    with serving(Judge(lambda body: completion(reply))) as url:
        assert _judge(url, model="j")("x", TASK)[0] == pytest.approx(expected)


def test_a_custom_pattern_and_scale_and_the_endpoints_model():
    judge = Judge(lambda body: completion("verdict 3/5"))
    with serving(judge) as url:
        reward = _judge(url, score_pattern=r"verdict (\d)/5", max_score=5)
        assert reward("x", TASK)[0] == pytest.approx(0.6)
    assert judge.requests[0]["model"] == "judge-model"  # from /models


def test_a_chat_task_is_shown_as_its_messages():
    judge = Judge(lambda body: completion("Score: 5"))
    chat = Task(id="c", messages=[ChatMessage(role="user", content="Tom has 3 apples.")])
    with serving(judge) as url:
        _judge(url, model="j")("ok", chat)
    assert "user: Tom has 3 apples." in judge.requests[0]["messages"][0]["content"]


def test_server_errors_and_replies_without_a_score_are_retried():
    replies = iter([(503, "busy"), completion("I think it is fine"), completion("Score: 9")])
    judge = Judge(lambda body: next(replies))
    with serving(judge) as url:
        assert _judge(url, model="j", retries=2)("x", TASK)[0] == pytest.approx(0.9)
    assert len(judge.requests) == 3


def test_after_its_retries_the_judge_names_the_endpoint_and_the_reason():
    judge = Judge(lambda body: completion("no idea"))
    reason = r"judge at .*: no score after 3 tries: no score in the reply 'no idea'"
    with serving(judge) as url, pytest.raises(RewardServiceError, match=reason):
        _judge(url, model="j", retries=2)("x", TASK)
    assert len(judge.requests) == 3


def test_a_refused_request_is_not_retried():
    judge = Judge(lambda body: (400, '{"error": "prompt too long"}'))
    reason = r"refused with HTTP 400: .*prompt too long"
    with serving(judge) as url, pytest.raises(RewardServiceError, match=reason):
        _judge(url, model="j", retries=3)("x", TASK)
    assert len(judge.requests) == 1


def test_a_judge_that_never_answers_times_out_each_try():
    judge = Judge(lambda body: completion("Score: 1"), delay_s=2.0)
    with serving(judge) as url:
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match="no answer"):
            _judge(url, model="j", retries=1, timeout_s=0.3)("x", TASK)
        assert time.monotonic() - start < 2.0  # two tries of 0.3 s, not the 2 s replies


def test_a_judge_that_is_down_fails_and_its_task_is_given_up_with_the_reason():
    """Through the explorer's scheduler: the math workflow scored by a judge on a closed
    port; the task is tried again, then given up naming the judge."""
    with serving(Judge(lambda body: completion("Score: 1"))) as url:
        pass  # the port is closed now
    outcome = scheduled(_judge(url, model="j", retries=1, timeout_s=1), [TASK])
    assert outcome.groups == [] and outcome.retried == 1
    ((task, reason),) = outcome.failed
    assert task.id == "t1" and f"judge at {url}: no score after 2 tries: no answer" in reason


def test_the_cache_and_the_concurrency_bound():
    judge = Judge(lambda body: completion("Score: 6"), delay_s=0.2)
    responses = [f"answer {i}" for i in range(12)]
    with serving(judge) as url:
        reward = _judge(url, model="j", concurrency=3)
        scores = score_all(reward, [(r, TASK) for r in responses])
        again = score_all(reward, [(r, TASK) for r in responses[:4]])
    assert [s[0] for s in scores + again] == [pytest.approx(0.6)] * 16
    assert len(judge.requests) == 12  # the second time from the cache
    assert judge.most_in_flight == 3


def test_the_api_key_comes_from_the_environment(monkeypatch):
    judge = Judge(lambda body: completion("Score: 2"))
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    with serving(judge) as url:
        _judge(url, model="j", api_key_env="JUDGE_KEY")("x", TASK)
    assert judge.headers[0]["Authorization"] == "Bearer sk-test"
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ConfigError, match=r"\$JUDGE_KEY is not set"):
        _judge("http://x", api_key_env="JUDGE_KEY")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "reward.base_url"),
        ({"base_url": "http://x", "score_pattern": "("}, "not a regular expression"),
        ({"base_url": "http://x", "score_pattern": r"\d"}, "needs a group"),
        ({"base_url": "http://x", "rubric": "Grade {respons}"}, "reward.rubric"),
        ({"base_url": "http://x", "rubric": "Grade {prompt}"}, "never shows the judge"),
    ],
)
def test_a_judge_config_that_cannot_work_is_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        get_reward("judge", service=RewardConfig(**settings))
