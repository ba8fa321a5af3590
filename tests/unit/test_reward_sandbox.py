"""``explorer.reward: code_tests``: real programs in the real sandbox (subprocesses under
rlimits, a network namespace where the kernel gives one, the audit hook): passing,
failing, looping, memory-hungry, network-reaching, exiting-early and escaping programs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

from streamrft.infra.config import RewardConfig, SandboxConfig
from streamrft.producers import reward_sandbox
from streamrft.producers.reward_sandbox import (
    NAMESPACES,
    CodeTestsReward,
    extract_code,
    namespace_works,
    task_tests,
)
from streamrft.producers.rewards import get_reward, score_all
from streamrft.schemas.errors import ConfigError, RewardServiceError
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


def _passes(code: str, test: str, reward: CodeTestsReward | None = None) -> tuple[float, dict]:
    """``code`` then ``test`` (one), in the sandbox."""
    task = Task(id="one", metadata={"tests": json.dumps([test])})
    return (reward or _reward("audit"))(_fenced(code), task)


@pytest.mark.skipif(not namespace_works(), reason="no user namespaces on this machine")
def test_the_program_runs_in_a_pid_namespace_of_its_own():
    code = "import os\nPID = os.getpid()"
    assert _passes(code, "assert PID == 1", _reward("namespace"))[0] == 1.0
    assert _passes(code, "assert PID == 1", _reward("auto"))[0] == 1.0
    assert _passes(code, "assert PID != 1", _reward("audit"))[0] == 1.0


def test_a_machine_without_namespaces_refuses_namespace_and_warns_for_auto(monkeypatch, caplog):
    monkeypatch.setattr(reward_sandbox, "namespace_works", lambda: False)
    with pytest.raises(ConfigError, match=r"reward\.sandbox\.isolation: namespace, but"):
        _reward("namespace")
    reward_sandbox._warn_once.cache_clear()
    assert _reward("auto").prefix == [] and _reward("audit").prefix == []
    assert "kept off the network by an audit hook only" in caplog.text
    assert _passes(ADD, "assert add(1, 2) == 3", _reward("auto"))[0] == 1.0


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("kind", ["missing", "not executable", "not a program"])
def test_an_interpreter_that_does_not_start_is_refused_at_start(kind, isolation, tmp_path):
    python = tmp_path / "python3"
    if kind != "missing":
        python.write_text("not a program")
        python.chmod(0o755 if kind == "not a program" else 0o644)
    with pytest.raises(ConfigError, match=r"reward\.sandbox\.python: .*python3' does not start"):
        _reward(isolation, python=str(python))


def test_an_interpreter_may_be_named_by_its_path_or_found_on_path():
    by_path = _reward(python=sys.executable)
    assert _passes(ADD, "assert add(1, 2) == 3", by_path)[0] == 1.0
    if shutil.which("python3") is not None:
        assert _reward(python="python3").python == "python3"


def test_an_honest_program_may_import_the_standard_library():
    """Builtin and native modules the interpreter has not loaded yet come through the
    sandbox's checks of the import system."""
    code = (
        "import pwd, json, math, heapq, bisect, datetime, decimal, fractions, statistics\n"
        "import dataclasses, inspect, typing, functools, itertools, re, string\n"
        "VALUE = statistics.mean([math.sqrt(4), json.loads('2'), heapq.nsmallest(1, [2])[0]])\n"
        "ARGS = len(inspect.signature(statistics.mean).parameters)"  # reads __code__
    )
    test = "assert VALUE == 2 and type(VALUE) in (int, float) and ARGS == 1"
    assert _passes(code, test)[0] == 1.0


@pytest.mark.parametrize(
    "path",
    [
        "./../{rel}",
        "made/../../{rel}",
        "made//../../{rel}",
        "/{abs}",
        "{abs}",
    ],
)
@pytest.mark.parametrize("kind", ["str", "bytes", "lying str"])
def test_every_spelling_of_a_path_outside_is_refused(path, kind, tmp_path):
    target = tmp_path / "escaped"
    name = path.format(rel=os.path.relpath(target, tempfile.gettempdir()), abs=str(target))
    spelled = {
        "str": repr(name),
        "bytes": repr(name.encode()),
        # a str whose methods say it is inside: the hook reads its characters
        "lying str": f"type('S', (str,), {{'startswith': lambda *a: True, "
        f"'split': lambda s, *a: ['inside']}})({name!r})",
    }[kind]
    code = f"import os\nos.mkdir('made')\nopen({spelled}, 'w').write('x')\n" + ADD
    assert _passes(code, "assert add(1, 2) == 3")[0] == 0.0
    assert not target.exists()


def test_links_are_followed_as_far_as_the_kernel_follows_them(tmp_path):
    """Links the program did not make (it may not make any): a chain of 40, the kernel's
    limit, is read; a loop is refused at once, not followed for ever."""
    (tmp_path / "file").write_text("x")
    for i in range(40):
        os.symlink(tmp_path / ("file" if i == 0 else f"l{i - 1}"), tmp_path / f"l{i}")
    read = f"DATA = open({str(tmp_path / 'l39')!r}).read()\n"
    assert _passes(read, "assert DATA == 'x'")[0] == 1.0
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    loop = f"try:\n    open({str(tmp_path / 'a')!r})\nexcept PermissionError:\n    SEEN = 1\n"
    value, info = _passes(loop, "assert SEEN == 1")
    assert value == 1.0 and info["tests_timed_out"] == 0


def test_a_path_that_climbs_back_into_the_folder_is_the_folders():
    code = "import os\nos.mkdir('made')\nopen('made/../ok.txt', 'w').write('x')\n" + ADD
    assert _passes(code, "assert open('ok.txt').read() == 'x'")[0] == 1.0


def test_a_file_rewritten_or_only_read_spends_none_of_the_budget():
    code = (
        "import os\n"
        "for i in range(20):\n"
        "    try:\n"
        "        os.open(f'absent{i}', os.O_WRONLY)\n"
        "    except FileNotFoundError:\n"
        "        pass\n"
        "    open('f', 'w').write('x')\n"
        "    os.close(os.open('f', os.O_WRONLY | os.O_CREAT))\n"
        "    try:\n"
        "        open(f'missing{i}')\n"
        "    except FileNotFoundError:\n"
        "        pass\n"
        "try:\n"
        "    open('g', 'w')\n"
        "    SECOND = 'made'\n"
        "except PermissionError:\n"
        "    SECOND = 'refused'\n"
    )
    test = "assert open('f').read() == 'x' and SECOND == 'refused'"
    assert _passes(code, test, _reward(files=1))[0] == 1.0


def test_a_program_holds_at_most_64_descriptors():
    code = (
        "import os\n"
        "used = 0\n"
        "for fd in range(256):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "        used += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "open('f', 'w').close()\n"
        "held = []\n"
        "while True:\n"
        "    try:\n"
        "        held.append(open('f'))\n"
        "    except OSError:\n"
        "        break\n"
        "TOTAL = used + len(held)\n"
    )
    assert _passes(code, "assert TOTAL == 64")[0] == 1.0


def test_a_file_stops_at_output_kb_and_the_folder_says_so():
    code = "try:\n    open('big', 'wb').write(b'x' * 5000)\nexcept OSError:\n    pass\n" + ADD
    value, info = _passes(code, "assert add(1, 2) == 3", _reward(output_kb=4))
    assert value == 1.0 and info["folder_bytes"] == 4096


def test_the_address_space_is_memory_mb():
    small = "blob = bytearray(64 << 20)\n" + ADD
    large = "blob = bytearray(300 << 20)\n" + ADD
    assert _passes(small, "assert add(1, 2) == 3")[0] == 1.0
    assert _passes(large, "assert add(1, 2) == 3")[0] == 0.0  # 256 MiB in _reward


def test_native_code_from_outside_the_interpreters_folders_is_refused(tmp_path):
    """A native module copied where the explorer's user may write (here: beside the test)
    does not load; the same module from the interpreter's folder does."""
    import importlib.util

    spec = importlib.util.find_spec("_bisect")
    assert spec is not None and spec.origin is not None and spec.origin.endswith(".so")
    copy = tmp_path / os.path.basename(spec.origin)
    shutil.copy(spec.origin, copy)
    load = (
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('_bisect', {path!r})\n"
        "LOADED = importlib.util.module_from_spec(spec).bisect_right([1, 3], 2)\n"
    )
    assert _passes(load.format(path=str(copy)), "assert LOADED == 1")[0] == 0.0
    assert _passes(load.format(path=spec.origin), "assert LOADED == 1")[0] == 1.0


def test_namespace_works_says_what_unshare_does(monkeypatch):
    unshare = shutil.which("unshare")
    works = unshare is not None and (
        subprocess.run([unshare, *NAMESPACES, "true"], capture_output=True).returncode == 0
    )
    assert namespace_works.__wrapped__() is works
    monkeypatch.setattr(reward_sandbox.shutil, "which", lambda name: None)
    assert namespace_works.__wrapped__() is False


def _recording_python(tmp_path) -> tuple[str, Path]:
    """An interpreter that leaves a mark each time it starts."""
    mark, script = tmp_path / "started", tmp_path / "python"
    script.write_text(f'#!/bin/sh\ntouch {mark}\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script), mark


def test_no_program_starts_past_the_deadline(tmp_path):
    python, mark = _recording_python(tmp_path)
    reward = _reward(python=python)
    assert mark.exists()  # the check at start ran it once
    mark.unlink()
    with pytest.raises(RewardServiceError, match=r"took longer than reward\.timeout_s"):
        reward.run_test(ADD, "assert add(1, 2) == 3", deadline=time.monotonic() - 1)
    assert not mark.exists()
    assert reward.run_test(ADD, "assert add(1, 2) == 3").verdict == "passed"
    assert mark.exists()


def test_an_interpreter_gone_after_the_start_is_the_reward_services_error(tmp_path):
    python, _mark = _recording_python(tmp_path)
    reward = _reward("audit", python=python)
    os.chmod(python, 0o644)
    with pytest.raises(RewardServiceError, match=f"code_tests: cannot start {python}: "):
        reward(GOOD, TASK)


def test_a_refused_import_names_the_module():
    code = "try:\n    import readline\nexcept PermissionError as e:\n    WHY = str(e)\n"
    assert _passes(code, "assert 'readline' in WHY")[0] == 1.0


@pytest.mark.parametrize("time_limit_s", [2.5, 3.0])
def test_the_cpu_time_backstop_is_a_second_past_the_wall_clock(time_limit_s):
    """The program's CPU limit is whole seconds: the wall-clock limit and a second more."""
    code = "import resource\nSOFT, HARD = resource.getrlimit(resource.RLIMIT_CPU)\n"
    check = f"assert SOFT == HARD and {time_limit_s + 1} <= SOFT < {time_limit_s + 2}"
    assert _passes(code, check, _reward("audit", time_limit_s=time_limit_s))[0] == 1.0


def test_a_test_due_now_starts_no_program(tmp_path, monkeypatch):
    """At or past the deadline the deadline's error comes before any start: with the
    interpreter gone, a start would be refused with another error."""
    python, _mark = _recording_python(tmp_path)
    reward = _reward("audit", python=python)
    os.chmod(python, 0o644)
    with pytest.raises(RewardServiceError, match=r"took longer than reward\.timeout_s"):
        reward.run_test(ADD, "assert add(1, 2) == 3", deadline=time.monotonic() - 1)
    frozen = types.SimpleNamespace(monotonic=lambda: 1000.0)
    monkeypatch.setattr(reward_sandbox, "time", frozen)
    with pytest.raises(RewardServiceError, match=r"took longer than reward\.timeout_s"):
        reward.run_test(ADD, "assert add(1, 2) == 3", deadline=1000.0)


def test_an_interpreter_that_does_not_start_is_refused_with_what_it_said(tmp_path):
    """The reason is the end of its error output (its last 300 characters), else its
    status."""
    python = tmp_path / "python3"
    python.write_text(
        "#!/bin/sh\nprintf 'x%.0s' $(seq 100) >&2\nprintf 'y%.0s' $(seq 300) >&2\nexit 3\n"
    )
    python.chmod(0o755)
    with pytest.raises(ConfigError) as said:
        _reward("audit", python=str(python))
    assert f"({'y' * 300})" in str(said.value)
    python.write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(ConfigError, match=r"python3' does not start \(status 3\)"):
        _reward("audit", python=str(python))
