"""Runs one test of ``explorer.reward: code_tests`` on a program, under limits.

Started by :mod:`streamrft.producers.reward_sandbox` as a script (``python -I
sandbox_harness.py MEMORY_BYTES CPU_SECONDS FILE_BYTES FILES``) in an empty temporary
folder, its stdout a file the explorer holds open (no name in the folder); imports the
standard library only. Its stdin carries a one-time token, the program and the test: it
reads them to the end and closes it, so the test's text is nowhere the program can read.

It compiles both, takes what the verdict needs (``exec``, ``os.write``, ``os._exit``, the
token, the built-ins as they are before the program runs) onto a thread of its own, sets its
limits (address space, CPU time, file size, open files, no core files, no new processes),
takes away what the audit hook cannot see (``os.mkfifo``, ``os.mknod``, new threads, the
import system's ways to a fresh copy of those modules or to native code of the program's
own), installs the audit hook, and runs the program and then the test on that thread. It
writes the token last, only when both ran to their end: a program that exits early
(``sys.exit(0)``, ``os._exit``) or fails an assertion does not pass. The main thread only
waits; Python runs signal handlers there alone, so the program (on the other thread, where
``signal.signal`` refuses) never gets a frame from one.

The test runs with the built-ins captured before the program ran and sees none of the
program's names that shadow a built-in: a program that replaces ``builtins.type`` or
``builtins.isinstance``, or defines its own ``type``, does not change what ``type(r) is
int`` checks, so an object equal to everything fails a test that checks types.

The audit hook refuses: sockets, subprocesses and the modules that make them, ``fork``,
signals to other processes, ``ctypes``, tracing and profiling, every way to a frame
(``sys._getframe``, a traceback's, a generator's or coroutine's frame, the garbage
collector's object lists; ``sys._getframe`` raises ValueError, as on a stack too shallow,
which ``collections.namedtuple``, ``typing`` and ``logging`` catch), new code objects, symbolic links, changing folder, opening any
directory (a descriptor of one would resolve paths the hook cannot see), writing, renaming,
linking or removing outside the folder, anything under ``/proc`` however it is reached (the
real path is resolved when the file is opened), modules that write files without an audit
event (``readline``, ``dbm``, ``sqlite3``, POSIX shared memory), and more than ``FILES``
files or folders made in the folder (each at most ``FILE_BYTES``: the folder's budget).
Everything it uses was taken before the program ran, so replacing a module's function or a
built-in does not loosen it.
"""

import _imp
import _thread
import builtins
import os
import posix
import resource
import stat
import sys
import types

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
    "os.symlink",
    "os.chdir",
    "os.chroot",
    "os.setxattr",
    "signal.pthread_kill",
    "ctypes.",
    "pty.",
    "gc.",
    "sqlite3.",
    "code.__new__",
    "sys._current_frames",
    "sys._current_exceptions",
    "sys.setprofile",
    "sys.settrace",
    "sys.addaudithook",
    "sys.monitoring.",
    "cpython.PyInterpreterState_",
    "webbrowser.",
)
"""Audit events refused (prefixes)."""
MODULES = frozenset((
    "_posixsubprocess", "subprocess", "multiprocessing", "_multiprocessing",
    "_xxsubinterpreters", "_ctypes", "readline", "_posixshmem", "_dbm", "_gdbm", "_sqlite3",
    "_thread", "posix", "_imp",
))  # fmt: skip
"""Modules that may not be imported (any part of a dotted name; and ``_test*``). The last
three are loaded already, with what the hook cannot see taken away: a fresh copy would
bring it back."""
FRAMES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back")
"""Attributes that lead to a frame (``object.__getattr__`` events)."""
PATHS = (
    "os.remove", "os.rename", "os.replace", "os.rmdir", "os.mkdir", "os.link", "os.chmod",
    "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
)  # fmt: skip
"""Audit events every path argument of which must lie inside the folder."""
MAKES = ("os.mkdir", "os.link")
"""Audit events that make a file or folder."""
UNSEEN = ("mkfifo", "mknod")
"""Functions of ``os`` that make files without an audit event: taken away."""
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
"""Open flags that change or make a file."""
OPEN_FILES = 64
"""Descriptors the program may hold open (``RLIMIT_NOFILE``)."""
MAX_LINKS = 40
"""Symbolic links followed resolving one path, as the kernel does."""


def _blocker(modules=MODULES, test="_test"):
    """A function telling whether a module name (dotted, an exact str) is one that may not
    be imported or created; it uses no built-in the program could replace."""

    def blocked(name):
        for part in name.split("."):  # noqa: SIM110 — any() is a built-in the program can replace
            if part in modules or part.startswith(test):
                return True
        return False

    return blocked


def _real(root, proc="/proc"):
    """A function giving the real path of a path (relative ones from ``root``, the folder
    the program never leaves), links followed as they are now; it raises PermissionError
    for a path whose resolution touches ``/proc``. Built from references taken now."""
    lstat, readlink, is_link = os.lstat, os.readlink, stat.S_ISLNK
    oserror, refused, most = OSError, PermissionError, MAX_LINKS
    under = proc + "/"

    def real(path):
        if not path.startswith("/"):
            path = root + "/" + path
        todo, done, hops = path.split("/")[::-1], [], 0
        while todo:
            name = todo.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                done = done[:-1]
                continue
            here = "/" + "/".join([*done, name])
            if here == proc or here.startswith(under):
                raise refused("sandbox: /proc is not reachable")
            try:
                link = is_link(lstat(here).st_mode)
            except oserror:
                link = False  # not there (yet): taken as written
            if not link:
                done.append(name)
                continue
            hops += 1
            if hops > most:
                raise refused("sandbox: too many levels of links")
            target = readlink(here)
            if target.startswith("/"):
                done = []
            todo.extend(target.split("/")[::-1])
        return "/" + "/".join(done)

    return real


def _hook_for(root, budget):
    """The audit hook of a program whose folder is ``root`` and that may make ``budget``
    files or folders in it; every name it uses is bound here, before the program runs."""
    real, blocked = _real(root), _blocker()
    inside_prefix = root + "/"
    text, data, number, type_ = str, bytes, int, type
    join, bjoin, decode, isinstance_ = "".join, b"".join, bytes.decode, isinstance
    stat_, is_dir, oserror, refused, shallow = (
        os.stat,
        stat.S_ISDIR,
        OSError,
        PermissionError,
        ValueError,
    )
    refused_events, frames, paths, makes, writes, create = (
        REFUSED, FRAMES, PATHS, MAKES, WRITES, os.O_CREAT
    )  # fmt: skip
    made = [0]

    def path_of(arg):
        # an exact str, whatever subclass came: its methods are the program's to change
        if isinstance_(arg, text):
            return join((arg,))
        if isinstance_(arg, data):
            return decode(bjoin((arg,)), "utf-8", "surrogateescape")
        return None

    def inside(path):
        return path == root or path.startswith(inside_prefix)

    def spend():
        made[0] += 1
        if made[0] > budget:
            raise refused(f"sandbox: a program may make {budget} files or folders")

    def opening(path, flags):
        if type_(path) is number:
            return  # a descriptor it holds: its file was checked when it was opened
        where = real(path_of(path))  # str or bytes: what the interpreter's event carries
        try:
            mode = stat_(where).st_mode
        except oserror:
            mode = None
        if mode is not None and is_dir(mode):
            raise refused("sandbox: opening a directory is not allowed")
        if type_(flags) is not number or flags & writes:
            if not inside(where):
                raise refused("sandbox: writing outside the folder is not allowed")
            if mode is None and (type_(flags) is not number or flags & create):
                spend()

    def hook(event, args):
        if event == "sys._getframe":  # as a stack too shallow: what the stdlib catches
            raise shallow("sandbox: frames are not reachable")
        if event.startswith(refused_events):
            raise refused(f"sandbox: {event} is not allowed")
        # the interpreter's events have fixed arguments; one the program raises itself
        # (sys.audit) with fewer fails here, which refuses only its own call
        if event == "import":
            name = path_of(args[0])
            if name is None or blocked(name):
                raise refused(f"sandbox: importing {args[0]!r} is not allowed")
        if event == "object.__getattr__" and args[1] in frames:
            raise refused("sandbox: frames are not reachable")
        if event == "open":
            opening(args[0], args[2])
        if event in paths:  # int arguments are modes, sizes or descriptors
            for arg in args:
                name = path_of(arg)
                if name is not None and not inside(real(name)):
                    raise refused(f"sandbox: {event} outside the folder is not allowed")
            if event in makes:
                spend()

    return hook


def _disarm(root, prefixes):
    """Take away what the audit hook cannot see: ``os.mkfifo`` and ``os.mknod``, starting
    threads, and the import system's ways to a fresh copy of a module refused (a builtin
    made again) or to native code outside the interpreter's own folders."""
    unseen = [vars(posix).pop(name) for name in UNSEEN if name in vars(posix)]
    for value in list(vars(os).values()):
        if isinstance(value, set):  # os.supports_dir_fd and its kind hold them too
            value.difference_update(unseen)
    for name in UNSEEN:
        vars(os).pop(name, None)

    failed = RuntimeError

    def no_thread(*args, **kwargs):
        raise failed("can't start new thread")

    _thread.start_new_thread = _thread.start_new = no_thread
    make_builtin, make_dynamic = _imp.create_builtin, _imp.create_dynamic
    real, blocked, inside_prefix = _real(root), _blocker(), root + "/"
    namespace, join, refused = types.SimpleNamespace, "".join, PermissionError

    def create_builtin(spec):
        # read once, as an exact str (or TypeError): the spec is the program's to make
        name = join((spec.name,))
        if blocked(name):
            raise refused(f"sandbox: module {name!r} is not allowed")
        return make_builtin(namespace(name=name))

    def create_dynamic(spec, file=None):
        # its name is checked by the import event loading native code raises
        name, origin = join((spec.name,)), join((spec.origin,))
        where = real(origin)
        if where.startswith(inside_prefix) or not where.startswith(prefixes):
            raise refused(f"sandbox: native code from {origin!r} is not allowed")
        return make_dynamic(namespace(name=name, origin=origin), file)

    _imp.create_builtin, _imp.create_dynamic = create_builtin, create_dynamic


def _read_input(fd):
    """The token, the program and the test, from ``fd`` (closed after): a line with the
    token, a line with the program's length in bytes, the program, the test."""
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    token, size, rest = b"".join(chunks).split(b"\n", 2)
    return token, rest[: int(size)], rest[int(size) :]


def _work(ready, done, run, program, test, fresh, line, write, leave):
    """The thread that runs the program and then the test, and writes the token only when
    both ran to their end. It uses nothing the program could replace."""
    ready.acquire()
    try:
        names = {"__name__": "__main__", "__builtins__": builtins}
        run(program, names)
        checked = {}
        for key, value in names.items():
            if key not in fresh:  # a built-in's name is the built-in's, for the test
                checked[key] = value
        checked["__builtins__"] = fresh
        checked["__name__"] = "__main__"
        run(test, checked)
        write(1, line)
        leave(0)
    except:  # noqa: E722 — bare: no name the program could have replaced; no pass
        pass
    done.release()


def _start():
    """Read the input, set the limits, start the thread; what the main thread keeps."""
    write, leave, run, start = os.write, os._exit, exec, _thread.start_new_thread
    token, program, test = _read_input(0)
    memory, cpu, file_bytes, files = (int(x) for x in sys.argv[1:5])
    root = os.path.realpath(os.getcwd())
    prefixes = tuple(
        os.path.join(os.path.realpath(p), "")
        for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    )
    solution = compile(program, "solution.py", "exec", dont_inherit=True)
    check = compile(test, "test.py", "exec", dont_inherit=True)
    fresh = vars(builtins).copy()
    ready, done = _thread.allocate_lock(), _thread.allocate_lock()
    ready.acquire()
    done.acquire()
    line = b"\n" + token + b"\n"
    start(_work, (ready, done, run, solution, check, fresh, line, write, leave))
    for kind, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_NOFILE, OPEN_FILES),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, 0),
    ):
        resource.setrlimit(kind, (value, value))
    _disarm(root, prefixes)
    sys.addaudithook(_hook_for(root, files))
    ready.release()
    return done, write, leave


def main():
    done, write, leave = _start()
    try:
        done.acquire()  # released only when the program or the test did not finish
    finally:
        write(2, b"the program failed or exited\n")
        leave(1)


if __name__ == "__main__":
    main()
