"""Runs one test program of ``explorer.reward: code_tests`` under limits.

Started by :mod:`streamrft.producers.reward_sandbox` as a script (``python -I
sandbox_harness.py MEMORY_BYTES CPU_SECONDS FILE_BYTES``) in an empty temporary folder
holding ``solution.py`` and ``test.py``; imports the standard library only. It reads a
one-time token from stdin and closes stdin, sets its limits (address space, CPU time,
file size, no core files), installs an audit hook that refuses sockets, subprocesses,
``ctypes``, signals to other processes, frame inspection and writing outside the folder,
runs the solution and then the test in one namespace, and prints the token last only
when both ran to their end: a program that exits early (``sys.exit(0)``, ``os._exit``)
or fails an assertion does not pass.
"""

import os
import resource
import sys

REFUSED = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "ctypes.",
    "pty.",
    "sys._getframe",
    "sys._current_frames",
    "sys.setprofile",
    "sys.settrace",
    "sys.addaudithook",
    "webbrowser.",
)
"""Audit events refused (prefixes)."""
WRITES = (
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.mkdir",
    "os.symlink",
    "os.link",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "shutil.rmtree",
    "os.unlink",
)
"""Audit events whose first argument must be a path inside the folder."""


def _inside(path, root):
    try:
        real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except (TypeError, ValueError):
        return False
    return real == root or real.startswith(root + os.sep)


def _hook_for(root):
    def hook(event, args):
        if event.startswith(REFUSED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event in WRITES and args and not _inside(args[0], root):
            raise PermissionError(f"sandbox: {event} outside the folder is not allowed")
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            mode, flags = args[1] or "", args[2] or 0
            writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR)
            if writing and not _inside(args[0], root):
                raise PermissionError("sandbox: writing outside the folder is not allowed")
            name = os.fsdecode(args[0])
            if name.startswith("/proc/") and name.endswith(("/mem", "/environ")):
                raise PermissionError("sandbox: reading process memory is not allowed")

    return hook


def main():
    token = sys.stdin.readline().strip()
    sys.stdin.close()
    memory, cpu, file_bytes = (int(x) for x in sys.argv[1:4])
    for kind, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))
    root = os.path.realpath(os.getcwd())
    with open("solution.py") as f:
        solution = compile(f.read(), "solution.py", "exec")
    with open("test.py") as f:
        test = compile(f.read(), "test.py", "exec")
    sys.addaudithook(_hook_for(root))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(solution, namespace)
        exec(test, namespace)
    except BaseException as exc:  # an exit or a failure of the program: no pass
        sys.stderr.write(f"{type(exc).__name__}: {str(exc)[:500]}\n")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.write("\n" + token + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
