"""``explorer.reward: code_tests``: real programs in the real sandbox (subprocesses under
rlimits, a network namespace where the kernel gives one, the audit hook): passing,
failing, looping, memory-hungry, network-reaching, exiting-early and escaping programs."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from streamrft.infra.config import RewardConfig, SandboxConfig
from streamrft.producers.reward_sandbox import (
    CodeTestsReward,
    extract_code,
    namespace_works,
    task_tests,
)
from streamrft.producers.rewards import get_reward, score_all
from streamrft.schemas.errors import RewardServiceError
from streamrft.schemas.experience import Task

pytestmark = pytest.mark.unit

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(20, 22) == 42"]
TASK = Task(id="add", prompt="Write add(a, b).", metadata={"tests": json.dumps(TESTS)})
GOOD = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\n"
ISOLATIONS = ["audit", *(["namespace"] if namespace_works() else [])]


def _reward(isolation: str = "auto", time_limit_s: float = 3.0, **more) -> CodeTestsReward:
    cfg = SandboxConfig(time_limit_s=time_limit_s, memory_mb=256, isolation=isolation, **more)
    return CodeTestsReward(cfg, concurrency=4, cache_size=64)


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def test_a_passing_program_passes_every_test_and_a_wrong_one_some():
    reward = _reward()
    value, info = reward(GOOD, TASK)
    assert value == 1.0
    assert info == {"tests_passed": 3, "tests_total": 3, "tests_timed_out": 0, "code_found": 1}
    value, info = reward(_fenced("def add(a, b):\n    return abs(a) + b"), TASK)
    assert value == pytest.approx(2 / 3) and info["tests_passed"] == 2  # add(-1, 1) fails
    assert reward("no code at all", TASK)[0] == 0.0  # the whole text is no program


def test_a_looping_program_is_killed_at_the_time_limit():
    reward = _reward(time_limit_s=1.0)
    start = time.monotonic()
    value, info = reward(_fenced("def add(a, b):\n    while True:\n        pass"), TASK)
    elapsed = time.monotonic() - start
    assert value == 0.0 and info["tests_timed_out"] == 3
    assert elapsed < 3 * 1.0 + 6  # three tests, each killed at about its limit


def test_a_memory_hungry_program_fails_and_leaves_the_explorer_alone():
    reward = _reward()
    hungry = "blob = bytearray(2 << 30)\ndef add(a, b):\n    return a + b"
    value, info = reward(_fenced(hungry), TASK)
    assert value == 0.0 and info["tests_timed_out"] == 0  # MemoryError at once


def test_an_early_exit_never_passes():
    reward = _reward()
    for code in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit(0)"):
        assert reward(_fenced(code), TASK)[0] == 0.0, code


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_program_reaching_the_network_fails_and_reaches_nothing(isolation):
    """A server listens on the machine's loopback; programs try to connect to it (socket
    and urllib) and to resolve a name: every test fails, and the server sees nobody."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    seen: list = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                seen.append(server.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        reward = _reward(isolation)
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=1)",
            "import socket\nsocket.getaddrinfo('example.com', 80)",
        ):
            program = code + "\ndef add(a, b):\n    return a + b"
            assert reward(_fenced(program), TASK)[0] == 0.0, code
    finally:
        stop.set()
        thread.join()
        server.close()
    assert seen == []


def test_a_program_cannot_write_outside_its_folder_or_start_processes(tmp_path):
    reward = _reward()
    target = tmp_path / "escaped"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\nos.fork()",
        "import ctypes\nctypes.CDLL(None)",
        "import sys\nsys._getframe(1)",
    ):
        program = code + "\ndef add(a, b):\n    return a + b"
        assert reward(_fenced(program), TASK)[0] == 0.0, code
    assert not target.exists()
    # its own folder is its to use
    inside = "open('scratch.txt', 'w').write('x')\ndef add(a, b):\n    return a + b"
    assert reward(_fenced(inside), TASK)[0] == 1.0


def test_the_same_response_to_the_same_task_runs_once():
    reward = _reward()
    pairs = [(GOOD, TASK)] * 4 + [(GOOD.replace("a + b", "b + a"), TASK)]
    scores = score_all(reward, pairs)
    assert [s[0] for s in scores] == [1.0] * 5
    assert reward.calls == 2
    reward(GOOD, TASK)
    assert reward.calls == 2


def test_what_is_run_is_the_last_python_block():
    text = "<think>```python\nbad()\n```</think>```js\nx\n```\n```py\ndef f(): pass\n```"
    assert extract_code(text) == ("def f(): pass\n", True)
    assert extract_code("def f(): pass") == ("def f(): pass", False)


def test_a_task_without_readable_tests_is_the_reward_services_error():
    reward = _reward()
    for metadata in ({}, {"tests": "[1, 2]"}, {"tests": "[]"}):
        with pytest.raises(RewardServiceError, match="task 'x'"):
            reward(GOOD, Task(id="x", metadata=metadata))
    assert task_tests(Task(id="y", metadata={"tests": "assert True"})) == ["assert True"]


def test_get_reward_builds_it_from_the_reward_section():
    reward = get_reward("code_tests", service=RewardConfig(sandbox=SandboxConfig(time_limit_s=2)))
    assert isinstance(reward, CodeTestsReward) and reward.cfg.time_limit_s == 2
    assert reward(GOOD, TASK)[0] == 1.0
