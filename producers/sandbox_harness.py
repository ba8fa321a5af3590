"""Runs one test program of ``explorer.reward: code_tests`` under limits.

Started by :mod:`streamrft.producers.reward_sandbox` as a script (``python -I
sandbox_harness.py MEMORY_BYTES CPU_SECONDS FILE_BYTES``) in an empty temporary folder
holding ``solution.py`` and ``test.py``; imports the standard library only. It reads a
one-time token from stdin and closes it, keeps what it needs at the end (``exec``,
``os.write``, ``os._exit``, the token) in local variables of its own frame, sets its
limits (address space, CPU time, file size, no core files, no new processes), installs an
audit hook, runs the solution and then the test in one namespace, and writes the token
last only when both ran to their end: a program that exits early (``sys.exit(0)``,
``os._exit``) or fails an assertion does not pass.

The audit hook refuses: sockets, subprocesses and the modules that make them
(``_posixsubprocess``, ``multiprocessing``), ``fork``, signals to other processes,
``ctypes``, tracing and profiling, every way to a frame (``sys._getframe``, a traceback's,
a generator's or coroutine's frame, the garbage collector's object lists), writing,
renaming, linking or removing outside the folder, opening a directory outside it (no
``dir_fd`` to write through), leaving it, and reading a process's memory or environment. Code in
the same process can still defeat a comparison it takes part in (an object equal to
everything); a test that checks types as well does not fall for that.
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
    "os.putenv",
    "os.unsetenv",
    "signal.pthread_kill",
    "ctypes.",
    "pty.",
    "gc.",
    "sys._getframe",
    "sys._current_frames",
    "sys._current_exceptions",
    "sys.setprofile",
    "sys.settrace",
    "sys.addaudithook",
    "cpython.PyInterpreterState_",
    "webbrowser.",
)
"""Audit events refused (prefixes)."""
MODULES = ("_posixsubprocess", "subprocess", "multiprocessing", "_xxsubinterpreters", "_ctypes")
"""Modules that may not be imported."""
FRAMES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back")
"""Attributes that lead to a frame (``object.__getattr__`` events)."""
PATHS = (
    "os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
    "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "os.unlink",
    "os.chdir", "os.chroot", "os.mkfifo", "os.mknod",
)  # fmt: skip
"""Audit events every path argument of which must lie inside the folder."""
PRIVATE = ("mem", "environ", "maps", "pagemap", "cmdline", "auxv", "stack")
"""Files of ``/proc/<pid>/`` that are never opened."""


def _inside(path, root):
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == root or real.startswith(root + os.sep)


def _hook_for(root):
    def hook(event, args):
        if event.startswith(REFUSED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "object.__getattr__" and len(args) > 1 and args[1] in FRAMES:
            raise PermissionError("sandbox: frames are not reachable")
        if event in PATHS:  # int arguments are modes, sizes or descriptors of the folder
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg, root):
                    raise PermissionError(f"sandbox: {event} outside the folder is not allowed")
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            mode, flags = args[1] or "", args[2] or 0
            writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR)
            if not _inside(args[0], root) and (writing or os.path.isdir(args[0])):
                # no writes outside, and no directory outside as a dir_fd to write through
                raise PermissionError("sandbox: writing outside the folder is not allowed")
            if os.path.basename(os.fsdecode(args[0])) in PRIVATE:
                raise PermissionError("sandbox: reading process state is not allowed")

    return hook


def main():
    write, leave, run = os.write, os._exit, exec  # out of the program's reach: locals
    token = os.read(0, 256).strip()
    os.close(0)
    memory, cpu, file_bytes = (int(x) for x in sys.argv[1:4])
    for kind, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, 0),
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
        run(solution, namespace)
        run(test, namespace)
    except BaseException:  # an exit or a failure of the program: no pass
        write(2, b"the program failed or exited\n")
        leave(1)
    write(1, b"\n" + token + b"\n")
    leave(0)


if __name__ == "__main__":
    main()
