"""Every scoring call of a reward service has a deadline: a response whose scoring runs past
``reward.timeout_s`` fails its task's workflow call (retried, then given up with the
reason, through the real rollout scheduler), and a call that overstays is abandoned
without holding up later scoring. Real threads, real sandboxed programs, a real HTTP
judge."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from streamrft.infra.config import RewardConfig, SandboxConfig
from streamrft.producers.reward_judge import PooledReward, Scored
from streamrft.producers.rewards import get_reward
from streamrft.schemas import ConfigError, Task
from streamrft.schemas.errors import RewardServiceError
from tests.helpers.scheduled import scheduled

pytestmark = pytest.mark.unit

TASK = Task(id="t1", prompt="3+4=", answer="7")
LIVENESS_S = 60.0
"""Bound on waiting for a call that should end (a hang fails the test instead)."""


class Held(PooledReward):
    """Scores ``"stuck"`` only once ``release`` is set, whatever its limit; anything else
    at once. Records how many ran at once."""

    def __init__(self, concurrency: int, limit_s: float) -> None:
        super().__init__(concurrency, 0, limit_s)
        self.release, self.ended = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.running = self.most_running = 0

    def score_one(self, response: str, task: Task) -> Scored:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if response == "stuck":
                self.release.wait()
                self.ended.set()
                return 0.5, {}
            return 1.0, {}
        finally:
            with self.lock:
                self.running -= 1


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except RewardServiceError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_call_past_its_limit_is_abandoned_and_its_place_given_to_the_next():
    reward = Held(concurrency=1, limit_s=0.2)
    reward.OVERRUN_S = 0.1
    with pytest.raises(RewardServiceError, match=r"took longer than 0\.2 s \(reward\.timeout_s\)"):
        reward.score_all([("stuck", TASK)])
    assert reward.abandoned == 1
    # the stuck call still runs, yet the one place is free for the next
    thread, out = _in_thread(lambda: reward.score_all([("a", TASK), ("b", TASK)]))
    thread.join(LIVENESS_S)
    assert out == {"value": [(1.0, {}), (1.0, {})]}
    reward.release.set()
    assert reward.ended.wait(LIVENESS_S)
    # its end gives back nothing twice: still one at a time
    reward.most_running = 0
    assert reward.score_all([(str(i), TASK) for i in range(4)]) == [(1.0, {})] * 4
    assert reward.most_running == 1


def test_a_queued_call_waits_for_its_turn_not_against_its_limit():
    """Four calls, one place, each taking longer than the next one's limit would allow
    if its clock ran while it waited: all are scored."""
    reward = Held(concurrency=1, limit_s=0.2)
    reward.release.set()
    assert (
        reward.score_all([("stuck", TASK)] + [(str(i), TASK) for i in range(3)])
        == [(0.5, {})] + [(1.0, {})] * 3
    )
    assert reward.abandoned == 0 and reward.most_running == 1


def test_code_tests_past_the_timeout_fail_the_task_which_is_retried_then_given_up():
    """Three tests that each run to their 1 s limit do not fit in ``timeout_s: 2.5``: the
    task's call fails, is tried again, then the task is given up with the reason."""
    loops = Task(
        id="loops",
        prompt="3+4=",
        answer="7",
        metadata={"tests": json.dumps(["while True:\n    pass"] * 3)},
    )
    service = RewardConfig(timeout_s=2.5, sandbox=SandboxConfig(time_limit_s=1.0))
    outcome = scheduled(get_reward("code_tests", service=service), [loops])
    assert outcome.groups == [] and outcome.retried == 1
    ((task, reason),) = outcome.failed
    assert task.id == "loops"
    assert "a response's tests took longer than reward.timeout_s (2.5 s)" in reason


def test_a_timeout_shorter_than_one_test_is_refused():
    service = RewardConfig(timeout_s=2, sandbox=SandboxConfig(time_limit_s=5))
    with pytest.raises(ConfigError, match=r"reward\.timeout_s: 2 s is shorter than one test's"):
        get_reward("code_tests", service=service)
    same = RewardConfig(timeout_s=5, sandbox=SandboxConfig(time_limit_s=5))
    assert get_reward("code_tests", service=same).limit_s == 5  # one test fits


@contextmanager
def dripping_judge(stop: threading.Event) -> Iterator[str]:
    """A judge that answers at once, then sends its reply one byte at a time, 0.2 s
    apart: each read is quick, the whole never ends in time."""
    body = json.dumps({"choices": [{"message": {"content": "Score: 7" + " " * 400}}]}).encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            for i in range(len(body)):
                if stop.wait(0.2):
                    return
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_a_judge_reply_that_never_ends_is_abandoned_at_the_deadline():
    stop = threading.Event()
    with dripping_judge(stop) as url:
        judge = get_reward(
            "judge", service=RewardConfig(base_url=url, model="j", timeout_s=1.0, retries=0)
        )
        judge.OVERRUN_S = 0.2  # type: ignore[attr-defined]
        thread, out = _in_thread(lambda: judge("x", TASK))
        thread.join(LIVENESS_S)
        assert not stop.is_set()  # cut off while the reply was still coming
    assert "took longer than 1 s" in str(out["error"])
