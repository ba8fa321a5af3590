"""``explorer.reward: code_tests``: a response's code is run against the task's tests in a
sandbox; the reward is the share of tests that pass.

The task's tests: ``metadata["tests"]``, a JSON list of Python snippets (each usually an
``assert``; a JSONL task's ``tests`` list lands there), or one snippet. The response's
code: its last fenced block (```` ```python ```` or plain ```` ``` ````), else the whole
response, ``<think>`` segments skipped. Each test is its own process
(:mod:`~streamrft.producers.sandbox_harness`) in a fresh, empty temporary folder: the
code and the test come on its stdin (no file holds the test), its stdout is an unnamed
file the explorer reads through its own descriptor. Limits (``reward.sandbox``):
wall-clock and CPU time (``time_limit_s``; CPU time a second more, a backstop), address
space (``memory_mb``), output and file size (``output_kb``), files made in the folder
(``files``), no core files, no new processes; off the network in a user, network and PID
namespace of its own when the kernel allows (``isolation``: every process it starts dies
with it), and always behind the harness's audit hook. A test passes only when the code
and the test both ran to their end (an early exit does not pass); its process group is
killed after every test. ``info``: ``tests_passed``, ``tests_total``, ``tests_timed_out``,
``code_found``, ``folder_bytes`` (the most a test's folder held at its end).

A sandbox is a bound on what the code can do to the explorer's machine, not a wall
against an attacker who targets it: run explorers that score untrusted code in
containers of their own as well.

Programs run ``reward.concurrency`` at once per explorer; scores are cached by
(task, response) digest like the judge's. A response's tests together may take
``reward.timeout_s``: past it, or when its tests cannot be read, or when the sandbox
cannot start, the task's workflow call fails with
:class:`~streamrft.schemas.errors.RewardServiceError` (retried, then dead-lettered).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import NamedTuple

from streamrft.infra.answer_extract import without_thinking
from streamrft.infra.config import SandboxConfig
from streamrft.producers.reward_judge import PooledReward, Scored, digest
from streamrft.schemas.errors import ConfigError, RewardServiceError
from streamrft.schemas.experience import Task

log = logging.getLogger(__name__)

TESTS_KEY = "tests"
"""The task metadata key holding its tests."""
HARNESS = Path(__file__).with_name("sandbox_harness.py")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
NAMESPACES = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
"""``unshare`` options: a user namespace (no privilege outside it), a network namespace
(no interface), a PID namespace whose every process dies with the program."""
KILL_GRACE_S = 2.0
"""Wait for a killed program's process group to be reaped."""
START_S = 30.0
"""Longest the interpreter's start-up check may take."""


def extract_code(response: str) -> tuple[str, bool]:
    """The response's code: its last fenced block (python or no language), else the whole
    response; and whether a fenced block was found."""
    text = without_thinking(response)
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in ("", "python", "py")]
    return (blocks[-1], True) if blocks else (text, False)


def task_tests(task: Task) -> list[str]:
    """The task's tests (see the module docstring); RewardServiceError when it has none
    that can be read."""
    raw = task.metadata.get(TESTS_KEY)
    if raw is None:
        raise RewardServiceError(f"task {task.id!r}: no metadata[{TESTS_KEY!r}] to run")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw  # one snippet, as text
    tests = [value] if isinstance(value, str) else value
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise RewardServiceError(
            f"task {task.id!r}: metadata[{TESTS_KEY!r}] is not a test or a list of tests"
        )
    return tests


@cache
def namespace_works() -> bool:
    """Whether ``unshare`` can give a program a user and network namespace here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        done = subprocess.run(
            [unshare, *NAMESPACES, "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def isolation_prefix(cfg: SandboxConfig) -> list[str]:
    """The command prefix that takes a program off the network (empty: the hook only)."""
    if cfg.isolation == "audit":
        return []
    if namespace_works():
        return [str(shutil.which("unshare")), *NAMESPACES, "--"]
    if cfg.isolation == "namespace":
        raise ConfigError(
            "reward.sandbox.isolation: namespace, but this machine gives no user and network "
            "namespace (unshare --user --net fails: user namespaces are off, or a container "
            "forbids them); use auto or audit to run behind the audit hook only"
        )
    _warn_once()
    return []


@cache
def _warn_once() -> None:
    log.warning(
        "code_tests: no network namespace on this machine; test programs are kept off the "
        "network by an audit hook only"
    )


class CodeTestsReward(PooledReward):
    """``explorer.reward: code_tests`` (see the module docstring)."""

    def __init__(
        self, cfg: SandboxConfig, concurrency: int, cache_size: int, timeout_s: float = 60.0
    ) -> None:
        if timeout_s < cfg.time_limit_s:
            raise ConfigError(
                f"reward.timeout_s: {timeout_s:g} s is shorter than one test's "
                f"reward.sandbox.time_limit_s ({cfg.time_limit_s:g} s): a program that runs "
                "to its limit would fail its task instead of the test"
            )
        super().__init__(concurrency, cache_size, timeout_s)
        self.cfg, self.python = cfg, cfg.python or sys.executable
        self.prefix = isolation_prefix(cfg)
        _check_starts([*self.prefix, self.python, "-I", "-c", "pass"])

    def key(self, response: str, task: Task) -> str:
        """The cache key: the response and the task's tests (the same task id may come
        with other tests: two task sets, corrected tests)."""
        return digest(task, response, task.metadata.get(TESTS_KEY, ""))

    def score_one(self, response: str, task: Task) -> Scored:
        deadline = time.monotonic() + self.limit_s
        tests = task_tests(task)
        code, fenced = extract_code(response)
        runs = [self.run_test(code, test, deadline) for test in tests]
        passed = sum(r.verdict == "passed" for r in runs)
        return passed / len(tests), {
            "tests_passed": float(passed),
            "tests_total": float(len(tests)),
            "tests_timed_out": float(sum(r.verdict == "timed out" for r in runs)),
            "code_found": float(fenced),
            "folder_bytes": float(max(r.folder_bytes for r in runs)),
        }

    def run_test(self, code: str, test: str, deadline: float = math.inf) -> Outcome:
        """``code`` then ``test`` in a fresh folder under the limits; past ``deadline``
        (``time.monotonic``) RewardServiceError: the scoring took longer than
        ``reward.timeout_s``."""
        cfg = self.cfg
        wall_s = min(cfg.time_limit_s, deadline - time.monotonic())
        if wall_s <= 0:
            raise RewardServiceError(self._late())
        limit_bytes = cfg.output_kb * 1024
        token = secrets.token_hex(16)
        body = code.encode("utf-8", "surrogatepass")
        feed = f"{token}\n{len(body)}\n".encode() + body + test.encode("utf-8", "surrogatepass")
        argv = [
            *self.prefix,
            self.python,
            "-I",
            str(HARNESS),
            str(cfg.memory_mb << 20),
            str(int(cfg.time_limit_s + 0.999) + 1),  # a backstop behind the wall clock
            str(limit_bytes),
            str(cfg.files),
        ]
        with (
            tempfile.TemporaryDirectory(prefix="streamrft-sandbox-") as folder,
            tempfile.TemporaryFile() as out,  # no name: the program cannot swap it
        ):
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=folder,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
                    start_new_session=True,
                )
            except OSError as exc:
                raise RewardServiceError(f"code_tests: cannot start {argv[0]}: {exc}") from exc
            try:
                proc.communicate(feed, timeout=wall_s)
            except subprocess.TimeoutExpired:
                if wall_s < cfg.time_limit_s:
                    raise RewardServiceError(self._late()) from None
                verdict = "timed out"
            else:
                tail = _tail(out.fileno(), limit_bytes)
                if proc.returncode == 0 and tail.rstrip().endswith(token):
                    verdict = "passed"
                elif proc.returncode == -signal.SIGXCPU:
                    verdict = "timed out"
                else:
                    verdict = "failed"
            finally:
                _kill(proc)  # whatever it left behind in its process group
            return Outcome(verdict, folder_bytes(Path(folder)))

    def _late(self) -> str:
        return (
            f"code_tests: a response's tests took longer than reward.timeout_s ({self.limit_s:g} s)"
        )


class Outcome(NamedTuple):
    """How one test ended: ``passed``, ``failed`` or ``timed out``, and the bytes its
    folder's files held at the end."""

    verdict: str
    folder_bytes: int


def folder_bytes(root: Path) -> int:
    """The bytes the files under ``root`` hold (links not followed, folders not counted)."""
    total = 0
    for here, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(here, name)).st_size
            except OSError:
                continue  # removed meanwhile: nothing to count
    return total


def _check_starts(argv: list[str]) -> None:
    """ConfigError unless ``argv`` (the interpreter, behind the isolation's prefix) runs:
    behind ``unshare`` an interpreter that cannot start would fail every test silently."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=START_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        reason = str(exc)
    else:
        if done.returncode == 0:
            return
        reason = (
            done.stderr.decode("utf-8", "replace").strip()[-300:] or f"status {done.returncode}"
        )
    raise ConfigError(f"reward.sandbox.python: {argv[-4]!r} does not start ({reason})")


def _kill(proc: subprocess.Popen) -> None:
    """Kill the program's whole process group (a PID namespace's whole tree goes with its
    first process), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        log.warning("code_tests: program %d outlived its kill", proc.pid)


def _tail(fd: int, limit: int) -> str:
    """The last 200 characters of a program's output, read through the descriptor the
    explorer holds (the output is at most ``limit`` bytes)."""
    end = min(os.fstat(fd).st_size, limit)
    return os.pread(fd, 200, max(0, end - 200)).decode("utf-8", "replace")
