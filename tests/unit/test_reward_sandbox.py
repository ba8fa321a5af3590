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
    assert info == {
        "tests_passed": 3,
        "tests_total": 3,
        "tests_timed_out": 0,
        "code_found": 1,
        "folder_bytes": 0,
    }
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


FAILING = Task(id="fail", metadata={"tests": json.dumps(["assert add(1, 2) == 4"])})
"""A test no right solution passes: only a faked pass would."""
ADD = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize(
    "trick",
    [
        "import builtins\nbuiltins.exec = lambda *a, **k: None",  # the test never runs
        "import sys\nsys.modules['__main__'].exec = lambda *a, **k: None",
        "try:\n    raise ValueError\nexcept ValueError as e:\n    f = e.__traceback__.tb_frame",
        "def g():\n    yield 1\nx = g()\nf = x.gi_frame",
        "import gc\nobjs = gc.get_objects()",
        "import sys\nsys.settrace(lambda *a: None)",
        "import os\nos.write(1, b'\\n' + b'0' * 32 + b'\\n')\nos._exit(0)",
        "import _posixsubprocess",
        "import multiprocessing",
        "import os\nos.chdir('/proc/self')",
        "open('/proc/self/environ').read()",
    ],
)
def test_a_program_cannot_fake_a_pass(trick):
    assert _reward()(_fenced(ADD + trick), FAILING)[0] == 0.0
    assert _reward()(_fenced(ADD + "x = 1"), FAILING)[0] == 0.0  # and the test is real
    assert (
        _reward()(_fenced(ADD), Task(id="ok", metadata={"tests": "assert add(1, 2) == 3"}))[0]
        == 1.0
    )


@pytest.mark.parametrize(
    "write",
    [
        "open('inside', 'w').write('x')\nimport os\nos.rename('inside', {target!r})",
        "open('inside', 'w').write('x')\nimport os\nos.link('inside', {target!r})",
        "import os\nos.symlink('/etc/hostname', {target!r})",
        "import os\nfd = os.open({folder!r}, os.O_RDONLY)\n"
        "os.open('escaped', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "import os\nos.mkdir({target!r})",
        "import shutil\nshutil.rmtree({folder!r})",
    ],
)
def test_a_program_cannot_write_or_remove_outside_its_folder(write, tmp_path):
    target, keep = tmp_path / "escaped", tmp_path / "kept"
    keep.write_text("x")
    code = write.format(target=str(target), folder=str(tmp_path))
    assert _reward()(_fenced(ADD + code), TASK)[0] == 0.0
    assert not target.exists() and keep.read_text() == "x"


def test_the_cache_key_holds_the_tests():
    reward = _reward()
    other = Task(id=TASK.id, prompt=TASK.prompt, metadata={"tests": json.dumps(["assert False"])})
    assert reward(GOOD, TASK)[0] == 1.0
    assert reward(GOOD, other)[0] == 0.0  # same id and response, other tests: run again


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
