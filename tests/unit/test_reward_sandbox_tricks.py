"""``explorer.reward: code_tests`` against programs written to be paid without solving the
task: each trick, added to a wrong program, scores what the wrong program scores (0.0),
in every isolation this machine gives; a right program still scores 1.0. Real programs in
the real sandbox, as in ``test_reward_sandbox.py``; each trick here passed or hung the
sandbox before it was closed."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from streamrft.infra.config import SandboxConfig
from streamrft.producers.reward_sandbox import CodeTestsReward, namespace_works
from streamrft.schemas.experience import Task

pytestmark = pytest.mark.unit

ISOLATIONS = ["audit", *(["namespace"] if namespace_works() else [])]

EQUAL = Task(
    id="equal",
    metadata={"tests": json.dumps(["assert add(2, 3) == 5", "assert add(10, -4) == 6"])},
)
"""Tests that compare values only."""
TYPED = Task(
    id="typed",
    metadata={
        "tests": json.dumps(
            [
                "r = add(2, 3)\nassert type(r) is int and r == 5",
                "r = add(10, -4)\nassert isinstance(r, int) and type(r) is int and r == 6",
            ]
        )
    },
)
"""Tests that check the type as well: an object equal to everything fails them."""
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"

READS_THE_TEST = r"""
import re
_table = {}
for args, want in re.findall(r"add\(([^()]*)\)\s*==\s*([-\d]+)", open("test.py").read()):
    _table[tuple(int(x) for x in args.split(","))] = int(want)
def add(a, b):
    return _table.get((a, b), 0)
"""
READS_IT_BACK = """
import os
TEXT = ""
for read in (
    lambda: open("test.py").read(),
    lambda: open("/dev/stdin").read(),
    lambda: os.read(0, 1 << 20).decode(),
):
    try:
        TEXT += read()
    except OSError:
        pass
"""
PATCHES_BUILTINS = """
import builtins
class Yes(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
_type = builtins.type
builtins.type = lambda *a: int if len(a) == 1 else _type(*a)
builtins.isinstance = lambda *a: True
def add(a, b):
    return Yes(0)
"""
SHADOWS_BUILTINS = """
class Same:
    def __eq__(self, other):
        return True
def type(x):
    return int
def isinstance(x, kind):
    return True
def add(a, b):
    return Same()
"""
SIGNAL_FRAME = """
import sys
_signal = sys.modules["_signal"]
def handler(signum, frame):
    while frame is not None and "token" not in frame.f_locals:
        frame = frame.f_back
    if frame is not None:
        names = frame.f_locals
        names["write"](1, b"\\n" + names["token"] + b"\\n")
        names["leave"](0)
_signal.signal(_signal.SIGUSR1, handler)
_signal.raise_signal(_signal.SIGUSR1)
"""
WALK_TO_THE_TOKEN = """
def _fake(frame):
    while frame is not None and "line" not in frame.f_locals:
        frame = frame.f_back
    if frame is not None:
        names = frame.f_locals
        names["write"](1, names["line"])
        names["leave"](0)
"""
TRACEBACK_FRAME = (
    WALK_TO_THE_TOKEN
    + """
try:
    raise ValueError
except ValueError as e:
    _fake(e.__traceback__.tb_frame)
"""
)
GETFRAME = WALK_TO_THE_TOKEN + "import sys\n_fake(sys._getframe())\n"
FIFO_STDOUT = """
import os
try:
    os.remove("stdout")
except OSError:
    pass
os.mkfifo("stdout")
"""
DIRECTORY_STDOUT = """
import os
try:
    os.remove("stdout")
except OSError:
    pass
os.mkdir("stdout")
"""

TRICKS = {
    "reads the test file": (EQUAL, READS_THE_TEST),
    "patches builtins.type and isinstance, returns an always-equal int": (
        TYPED,
        WRONG + PATCHES_BUILTINS,
    ),
    "shadows type and isinstance, returns an always-equal object": (
        TYPED,
        WRONG + SHADOWS_BUILTINS,
    ),
    "takes the harness's token from a signal handler's frame": (EQUAL, WRONG + SIGNAL_FRAME),
    "takes the harness's token from a traceback's frame": (EQUAL, WRONG + TRACEBACK_FRAME),
    "takes the harness's token from sys._getframe": (EQUAL, WRONG + GETFRAME),
    "puts a FIFO where stdout was": (EQUAL, WRONG + FIFO_STDOUT),
    "puts a directory where stdout was": (EQUAL, WRONG + DIRECTORY_STDOUT),
}


def _reward(isolation: str, **limits) -> CodeTestsReward:
    cfg = SandboxConfig(time_limit_s=5.0, memory_mb=256, isolation=isolation, **limits)
    return CodeTestsReward(cfg, concurrency=4, cache_size=0)


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("trick", list(TRICKS))
def test_a_trick_scores_what_the_wrong_program_scores(trick, isolation):
    task, code = TRICKS[trick]
    reward = _reward(isolation)
    assert reward(_fenced(WRONG), task)[0] == 0.0
    assert reward(_fenced(code), task)[0] == 0.0
    assert reward(_fenced(RIGHT), task)[0] == 1.0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_the_tests_text_is_nowhere_the_program_can_read_it(isolation):
    """The test passes only if the program found its text (on disk, or on the stdin it
    came through)."""
    task = Task(id="text", metadata={"tests": json.dumps(["assert 'TEXT' in TEXT"])})
    assert _reward(isolation)(_fenced(RIGHT + READS_IT_BACK), task)[0] == 0.0
    control = Task(id="control", metadata={"tests": json.dumps(["assert TEXT == 'x'"])})
    assert _reward(isolation)(_fenced("TEXT = 'x'"), control)[0] == 1.0


SYMLINK_SWAP = """
import os
deep = "a/b/c/e/f/g/h/i/j/k/l/m"
os.makedirs(deep)
os.symlink(deep, "d")
os.symlink("d/" + "../" * 12 + "proc/{pid}/environ", "x")
os.remove("d")
os.mkdir("d")
LEAK = open("x", "rb").read()
"""
"""A link made while it resolves inside the folder, then a directory swapped under it:
it reads the explorer's environment."""


@pytest.mark.parametrize(
    "read",
    [
        SYMLINK_SWAP,
        "LEAK = open('/proc/self/status', 'rb').read() + b'PATH='",
        "LEAK = open('/dev/fd/../status', 'rb').read() + b'PATH='",  # a system link into /proc
    ],
)
def test_proc_is_not_reachable_behind_the_hook_alone(read):
    """``isolation: audit``: the program runs as the explorer's user, so only the hook
    stands between it and ``/proc/<explorer>/environ``."""
    task = Task(id="leak", metadata={"tests": json.dumps(["assert b'PATH=' in LEAK"])})
    code = read.format(pid=os.getpid())
    assert _reward("audit")(_fenced(code), task)[0] == 0.0


NATIVE = """
import importlib.util
import os
for name in ("_uuid", "_crypt", "_contextvars", "_typing", "_bisect"):
    spec = importlib.util.find_spec(name)
    if spec and spec.origin.endswith(".so") and os.path.getsize(spec.origin) < 60000:
        break
with open(os.path.basename(spec.origin), "wb") as f:
    f.write(open(spec.origin, "rb").read())
copy = importlib.util.spec_from_file_location(name, os.path.basename(spec.origin))
module = importlib.util.module_from_spec(copy)
FROM_FOLDER = module.__file__ == copy.origin
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize(
    ("trick", "result"),
    [
        # writing outside the folder when the hook's own names are replaced
        (
            "import sys\nm = sys.modules['__main__']\nm.REFUSED = ()\nm._inside = lambda *a: True",
            "w",
        ),
        ("import builtins\nbuiltins.isinstance = lambda *a: False", "w"),
        ("import os.path\nos.path.realpath = lambda p, **k: os.getcwd()", "w"),
        # a descriptor of the folder, then a relative path from a folder below it
        (
            "import os\nfd = os.open('.', os.O_RDONLY)\nos.mkdir('sub')\nos.chdir('sub')\n"
            "os.close(os.open('../{name}', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n",
            None,
        ),
        ("import readline\nreadline.write_history_file({target!r})\n", None),
        ("import _posixshmem\n_posixshmem.shm_open('/streamrft-test', 64 | 2, 384)\n", None),
        (  # no import statement: the module made from its file
            "import _imp, importlib.machinery, importlib.util, os\n"
            "where = os.path.dirname(importlib.util.find_spec('_json').origin)\n"
            "so = [f for f in os.listdir(where) if f.startswith('_posixshmem')][0]\n"
            "spec = importlib.machinery.ModuleSpec('_posixshmem', None, origin=where + '/' + so)\n"
            "_imp.create_dynamic(spec).shm_open('/streamrft-test', 64 | 2, 384)\n",
            None,
        ),
        ("import sys\ndel sys.modules['_thread']\nimport _thread", None),
        ("import threading\nthreading.Thread(target=print).start()", None),
        (NATIVE, None),
    ],
    ids=[
        "hook-globals",
        "isinstance",
        "realpath",
        "dir-fd",
        "readline",
        "shm",
        "shm-by-spec",
        "fresh-thread-module",
        "thread",
        "native-code-from-the-folder",
    ],
)
def test_a_program_cannot_loosen_the_hook(trick, result, isolation, tmp_path):
    """Each trick is followed by a write outside the folder (``"w"``) or is itself one;
    a right program with it fails, and nothing lands outside."""
    target = tmp_path / "escaped"
    code = trick.format(name=os.path.relpath(target, tempfile.gettempdir()), target=str(target))
    if result == "w":
        code += f"\nopen({str(target)!r}, 'w').write('x')"
    try:
        assert _reward(isolation)(_fenced(RIGHT + code), EQUAL)[0] == 0.0
        assert not target.exists()
    finally:
        if os.path.exists("/dev/shm/streamrft-test"):
            os.unlink("/dev/shm/streamrft-test")
    assert _reward(isolation)(_fenced(RIGHT + "x = 1"), EQUAL)[0] == 1.0


MANY_FILES = """
import os
made = 0
for i in range(400):
    try:
        {make}
    except Exception:  # refused (PermissionError), or no such function
        continue
    made += 1
MADE = made
"""
MAKERS = {
    "open": "open(f'f{i}', 'wb').write(b'x' * 1024)",
    "os.open": "os.close(os.open(f'f{i}', os.O_WRONLY | os.O_CREAT))",
    "mkdir": "os.mkdir(f'd{i}')",
    "link": "open('f', 'a').close() if i == 0 else os.link('f', f'l{i}')",
    "mkfifo": "os.mkfifo(f'p{i}')",
    "mkfifo-kept": "[f for f in os.supports_dir_fd if f.__name__ == 'mkfifo'][0](f'p{i}')",
    "mkfifo-reloaded": "import importlib, posix\n        importlib.reload(posix).mkfifo(f'p{i}')",
    "mknod-fresh": "import _imp, importlib.util\n"
    "        _imp.create_builtin(importlib.util.find_spec('posix')).mknod(f'n{i}')",
}


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("make", list(MAKERS))
def test_the_folder_holds_at_most_its_budget_of_files(make, isolation):
    """Made in a loop until refused, by each way there is: 16 at most (the first file of
    ``link`` counts too); a right program that stays within it passes."""
    body = MANY_FILES.format(make=MAKERS[make])
    made = 0 if make.startswith(("mkfifo", "mknod")) else 16
    task = Task(id="files", metadata={"tests": json.dumps([f"assert MADE == {made}"])})
    reward = _reward(isolation, files=16, output_kb=4)
    value, info = reward(_fenced(RIGHT + body), task)
    assert value == 1.0
    assert info["folder_bytes"] <= 16 * 4096


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_many_small_files_stay_within_the_folders_budget(isolation):
    """The default budget: 64 files of at most ``output_kb`` (64 KiB); the program tries
    1000 of 1 KiB and scores what the wrong program scores."""
    fill = "for i in range(1000):\n    try:\n        open(f'f{i}', 'wb').write(b'x' * 1024)\n"
    fill += "    except OSError:\n        pass\n"
    reward = _reward(isolation)
    value, info = reward(_fenced(WRONG + fill), EQUAL)
    assert value == 0.0
    assert info["folder_bytes"] == 64 * 1024  # the first 64 made, the rest refused
    assert info["folder_bytes"] <= 64 * 64 * 1024


def test_the_reward_info_holds_the_largest_folder():
    tests = ["open('a', 'wb').write(b'x' * 300)\nassert add(1, 2) == 3", "assert add(1, 1) == 2"]
    task = Task(id="sizes", metadata={"tests": json.dumps(tests)})
    value, info = _reward("audit")(_fenced(RIGHT), task)
    assert value == 1.0 and info["folder_bytes"] == 300


def test_an_honest_program_may_use_what_looks_up_its_callers_frame():
    """``collections.namedtuple``, ``typing.NamedTuple``, ``enum`` and ``logging`` ask
    for a frame and take a refusal as a stack too shallow."""
    code = """
import collections, enum, logging, typing
Point = collections.namedtuple("Point", "x y")
class Pair(typing.NamedTuple):
    a: int
    b: int
Color = enum.Enum("Color", "RED GREEN")
logging.getLogger("solution").warning("adding")
def add(a, b):
    return Point(a, b).x + Pair(0, b).b
"""
    assert _reward("audit")(_fenced(code), EQUAL)[0] == 1.0
