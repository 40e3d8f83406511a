"""The sandboxed side of `gppo.rewards.code` (design and threat model: docs/sandbox.md).

Run inside the sandbox as `python -I -B -S _code_child.py REQUEST_FD REPLY_FD SITE_PACKAGES [UID]`,
or, in a `ProgramPool`, called in a fork of the pool's server (`_code_server.py`: `main_in_process`,
no new interpreter starts). It holds no test and decides nothing. It says it is ready, reads the
program, installs the audit hook (defence in depth), then either runs the program as `__main__`
(stdin/stdout tests: the caller reads its output and the bootstrap its exit status), or loads it
and answers the judge's calls with plain data (`_wire`) until the judge closes the channel.
"""

import atexit
import builtins
import importlib.machinery
import os
import resource
import stat
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _wire  # noqa: E402  (this directory is on sys.path only for this import)

del sys.path[0]

_MESSAGE_LIMIT = 64 << 20

# Audit events refused: network, processes, signals, native code, links, and the ways to the
# interpreter's frames, objects and control flow.
_REFUSED_EVENTS = frozenset(
    {
        "socket.__new__",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
        "os.symlink",
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "sys.addaudithook",
        "sys.monitoring.register_callback",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    }
)
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
# modules that reach native code or memory without an audit event (refused with ImportError,
# which libraries that can do without them expect: numpy without ctypes), and the unaudited
# process launcher (its fork_exec is replaced; a second copy is refused)
_REFUSED_MODULES = frozenset(
    {
        "ctypes",
        "_ctypes",
        "_testcapi",
        "_testinternalcapi",
        "_testbuffer",
        "_testmultiphase",
        "_xxsubinterpreters",
        "_xxinterpchannels",
    }
)
_PROCESS_MODULE = "_posixsubprocess"
# audit event -> the paths that must stay inside the working directory, as (index of the path,
# index of the directory descriptor it is relative to, or None) in the event's arguments
_PATH_EVENTS = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((1, 3),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def main(request_fd: int, reply_fd: int, site_packages: list[str], uid: int | None) -> None:
    """Become the program's process (as `uid` when given and root) and run or serve the program."""
    _prepare(site_packages)
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _wire.send(reply_fd, {"ready": True})
    hello = _wire.receive(request_fd, _MESSAGE_LIMIT)
    _guard_interpreter(site_packages)
    if hello["kind"] == "stdio":
        os.close(request_fd)
        os.close(reply_fd)
        _run_as_main(hello["source"])  # its exceptions and exit status are the outcome
        return
    _serve(hello["source"], request_fd, reply_fd)


def _prepare(site_packages: list[str]) -> None:
    """What `site` would have done that programs rely on."""
    sys.path += site_packages  # started with -S (40 ms less per start): no .pth file runs
    for name in ("exit", "quit"):  # the builtins `site` would add, which programs call
        setattr(builtins, name, __import__("_sitebuiltins").Quitter(name, "Ctrl-D (i.e. EOF)"))


def _guard_interpreter(site_packages: list[str]) -> None:
    """Just before the program runs: the refused modules forgotten, the process launcher replaced,
    the audit hook installed."""
    for name in list(sys.modules):  # imported already, so importing them again raises no event
        if name.partition(".")[0] in _REFUSED_MODULES:
            del sys.modules[name]
    __import__(_PROCESS_MODULE).fork_exec = _refused_fork_exec
    sys.addaudithook(
        _guard(
            os.getcwd(),
            site_packages,
            _REFUSED_EVENTS,
            _FRAME_ATTRIBUTES,
            _PATH_EVENTS,
            _REFUSED_MODULES | {_PROCESS_MODULE},
        )
    )


def set_limits(limits: dict) -> None:
    """The resource limits of the program's process, from `Limits`' fields (the bootstrap sets them
    before it starts that process, a pool's server in its fork)."""
    for limit, value in (
        (resource.RLIMIT_CPU, _wire.cpu_seconds(limits["timeout_s"])),  # soft = hard: SIGKILL, which even a PID 1 obeys
        (resource.RLIMIT_AS, limits["memory_mb"] << 20),
        (resource.RLIMIT_NPROC, limits["max_processes"]),
        (resource.RLIMIT_FSIZE, limits["max_output_bytes"] + 1),
        (resource.RLIMIT_NOFILE, limits["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def _run_as_main(source: str) -> None:
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module  # the harness's own module is not `import __main__`
    exec(compile(source, "solution.py", "exec", dont_inherit=True), module.__dict__)


def _serve(source: str, request_fd: int, reply_fd: int) -> None:
    """Load the program, send its top-level names (plain values by value, the rest as names the
    judge calls), then answer `{"call": [name or handle, attribute...], "args", "kwargs"}`."""
    module = types.ModuleType("solution")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    namespace = module.__dict__
    try:
        exec(_wire.PRELUDE, namespace)
        exec(compile(source, "solution.py", "exec", dont_inherit=True), namespace)
    except BaseException as error:  # noqa: BLE001  (the program's failure is the outcome)
        _wire.send(reply_fd, {"raised": _describe(error)})
        return
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        try:
            names[name] = None if callable(value) else _wire.tag(value)
        except _wire.NotPlain:
            names[name] = None
    _wire.send(reply_fd, {"names": names})
    objects: dict = {}
    while True:
        try:
            request = _wire.receive(request_fd, _MESSAGE_LIMIT)
        except _wire.ChannelClosed:
            return
        _wire.send(reply_fd, _call(request, namespace, objects))


def _call(request: dict, namespace: dict, objects: dict) -> dict:
    target = request["call"]
    try:
        obj = namespace[target[0]] if isinstance(target[0], str) else objects[target[0]]
        for attribute in target[1:]:
            obj = getattr(obj, attribute)
        result = obj(*_wire.untag(request["args"]), **_wire.untag(request["kwargs"]))
        if isinstance(obj, type):  # a new object of the program's class: the judge gets a handle
            objects[len(objects)] = result
            return {"handle": len(objects) - 1}
        return {"value": _wire.tag(result)}
    except _wire.NotPlain as error:
        return {"refused": f"{'.'.join(map(str, target))} returned {error}"}
    except BaseException as error:  # noqa: BLE001
        return {"raised": _describe(error)}


def _describe(error: BaseException) -> list:
    try:
        message = str(error)[:300]
    except BaseException:  # noqa: BLE001
        message = "(the message could not be read)"
    return [type(error).__name__, message]


def _refused_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed")


def _guard(workdir: str, site_packages: list[str], refused_events, frame_attributes, path_events, refused_modules):
    """The audit hook (defence in depth: the verdict does not depend on it). Its settings are
    bound here, not read from module globals that the program could change."""
    root = os.path.realpath(workdir)
    trees = frozenset(os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, *site_packages))
    extensions = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    realpath, fsdecode, basename, harness = os.path.realpath, os.fsdecode, os.path.basename, globals()
    join, isdir, fstat, readlink, getcwd = os.path.join, os.path.isdir, os.fstat, os.readlink, os.getcwd
    write_flags, directory_flags, is_directory = _WRITE_FLAGS, os.O_DIRECTORY | os.O_PATH, stat.S_ISDIR
    descriptors = range(os.sysconf("SC_OPEN_MAX"))  # RLIMIT_NOFILE, whose hard limit is set: no fd lies beyond
    opened_directory = False  # until the program opens a directory, no path can be relative to one

    def descriptor(fd: int) -> str:
        """Where an open descriptor leads (the directory a path relative to it starts from)."""
        try:
            return readlink(f"/proc/self/fd/{fd}")
        except OSError:
            raise PermissionError(f"sandbox: descriptor {fd} cannot be resolved") from None

    def directories() -> list[str]:
        """The directories the program holds open as descriptors."""
        found = []
        for fd in descriptors:
            try:
                if is_directory(fstat(fd).st_mode):
                    found.append(descriptor(fd))
            except OSError:
                pass  # not open
        return found

    def locations(path, dir_fd: int | None) -> list[str]:
        """Where `path` may lead: relative to `dir_fd` (negative: the current directory), or, for
        "open", whose event does not say which directory descriptor the path is relative to (as in
        `os.open(name, flags, dir_fd=fd)`), relative to the current directory and to each one held
        (once the program has opened a directory: before, it holds none)."""
        text = fsdecode(path)
        if os.path.isabs(text):
            return [text]
        if dir_fd is None:
            bases = [getcwd(), *(directories() if opened_directory else [])]
        else:
            bases = [getcwd() if dir_fd < 0 else descriptor(dir_fd)]
        return [join(base, text) for base in bases]

    def inside(location: str) -> bool:
        real = realpath(location)
        return real == root or real.startswith(root + os.sep)

    def in_proc(location: str) -> bool:
        """Whether `location` reaches into /proc, by where it resolves (not its text)."""
        full = os.path.abspath(location)
        for candidate in (full, realpath(full), realpath(os.path.dirname(full))):
            if candidate == "/proc" or candidate.startswith("/proc/"):
                return True
        return False

    def refused_import(name: str, filename) -> None:
        stems = set(name.split("."))
        if filename is not None:
            stems.add(basename(fsdecode(filename)).partition(".")[0])
            real = realpath(fsdecode(filename))
            if real.endswith(extensions) and not any(real.startswith(d + os.sep) for d in trees):
                raise ImportError(f"sandbox: loading the extension {real!r} is not allowed")
        if stems & refused_modules:
            raise ImportError(f"sandbox: importing {name} is not allowed")

    def hook(event: str, args: tuple) -> None:
        nonlocal opened_directory
        if event in refused_events:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "sys._getframe":  # ValueError: what the standard library expects without frames
            raise ValueError("sandbox: frames are not available")
        if event == "object.__getattr__" and args[1] in frame_attributes:
            raise PermissionError(f"sandbox: reading {args[1]} is not allowed")
        if event == "object.__setattr__" and args[1] == "__code__" and getattr(args[0], "__globals__", None) is harness:
            raise PermissionError("sandbox: replacing the code of the harness is not allowed")
        if event == "import":
            refused_import(str(args[0]), args[1])
        elif event == "open" and not isinstance(args[0], int) and args[0] is not None:  # an int: an open descriptor
            path, mode, flags = args
            places = locations(path, None)
            if any(in_proc(p) for p in places):
                raise PermissionError(f"sandbox: opening {path!r} (under /proc) is not allowed")
            writes = flags & write_flags or (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and not all(inside(p) for p in places):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
            opened_directory = opened_directory or bool(flags & directory_flags) or any(map(isdir, places))
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            path = "." if args[0] is None else args[0]
            places = [descriptor(path)] if isinstance(path, int) else locations(path, -1)
            if any(in_proc(p) for p in places):
                raise PermissionError(f"sandbox: {event} {path!r} (under /proc) is not allowed")
        elif event in path_events:
            for index, fd_index in path_events[event]:
                path, dir_fd = args[index], -1 if fd_index is None else args[fd_index]
                if not isinstance(path, int) and not all(inside(p) for p in locations(path, dir_fd)):
                    raise PermissionError(f"sandbox: {event} {path!r} outside the working directory")

    return hook


def main_in_process(source: str, site_packages: list[str]) -> None:
    """`main` for a stdin/stdout program in a fork of a `ProgramPool`'s server (which has made this
    process the program's: its uid, descriptors and limits), then the end of the process as the
    interpreter ends after a script (no interpreter of its own runs its shutdown): the exit status
    of an uncaught `SystemExit` or exception (printed), non-daemon threads joined, `atexit`
    handlers, the program's globals released (its unclosed files flushed), streams flushed."""
    try:
        _prepare(site_packages)
        _guard_interpreter(site_packages)
        _run_as_main(source)
        status = 0
    except SystemExit as error:
        status = _exit_status(error.code)
    except BaseException:  # noqa: BLE001  (printed, as the interpreter does)
        sys.excepthook(*sys.exc_info())
        status = 1
    for finish in (_join_threads, atexit._run_exitfuncs, _release_globals):
        try:
            finish()
        except BaseException:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001  (the interpreter's status for a failed flush)
            status = 120
    os._exit(status)


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        pass
    return 1


def _join_threads() -> None:
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()


def _release_globals() -> None:
    main_module = sys.modules.get("__main__")
    if main_module is not None:
        main_module.__dict__.clear()


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        [p for p in sys.argv[3].split(os.pathsep) if p],
        int(sys.argv[4]) if len(sys.argv) > 4 else None,
    )
