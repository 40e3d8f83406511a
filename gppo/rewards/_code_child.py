"""The sandboxed side of `gppo.rewards.code` (design and threat model: docs/sandbox.md).

Run inside the sandbox as
`python -I -B -S _code_child.py REQUEST_FD REPLY_FD WIRE_DIR SITE_PACKAGES [drop-root]`.
It holds no test and decides nothing. It says it is ready, reads the program, installs the audit
hook (defence in depth), then either runs the program as `__main__` (stdin/stdout tests: the
caller reads its output and the bootstrap its exit status), or loads it and answers the judge's
calls with plain data (`_wire`) until the judge closes the channel.
"""

import builtins
import importlib.machinery
import os
import sys
import types

sys.path.insert(0, sys.argv[3])
import _wire  # noqa: E402  (found through WIRE_DIR only)

del sys.path[0]
_SITE_PACKAGES = [p for p in sys.argv[4].split(os.pathsep) if p]
sys.path += _SITE_PACKAGES  # started with -S (40 ms less per start): no .pth file runs
for _name in ("exit", "quit"):  # the builtins `site` would add, which programs call
    setattr(builtins, _name, __import__("_sitebuiltins").Quitter(_name, "Ctrl-D (i.e. EOF)"))

_NOBODY = 65534
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
# audit event -> indices of the path arguments that must stay inside the working directory
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.link": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def main(request_fd: int, reply_fd: int, drop_root: bool) -> None:
    if drop_root and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)
    _wire.send(reply_fd, {"ready": True})
    hello = _wire.receive(request_fd, _MESSAGE_LIMIT)
    kind, source = hello["kind"], hello["source"]
    for name in list(sys.modules):  # imported already, so importing them again raises no event
        if name.partition(".")[0] in _REFUSED_MODULES:
            del sys.modules[name]
    __import__(_PROCESS_MODULE).fork_exec = _refused_fork_exec
    sys.addaudithook(
        _guard(os.getcwd(), _REFUSED_EVENTS, _FRAME_ATTRIBUTES, _PATH_EVENTS, _REFUSED_MODULES | {_PROCESS_MODULE})
    )
    if kind == "stdio":
        os.close(request_fd)
        os.close(reply_fd)
        _run_as_main(source)  # its exceptions and exit status are the outcome
        return
    _serve(source, request_fd, reply_fd)


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


def _guard(workdir: str, refused_events, frame_attributes, path_events, refused_modules):
    """The audit hook (defence in depth: the verdict does not depend on it). Its settings are
    bound here, not read from module globals that the program could change."""
    root = os.path.realpath(workdir)
    trees = frozenset(os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, *_SITE_PACKAGES))
    extensions = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    realpath, fsdecode, basename, harness = os.path.realpath, os.fsdecode, os.path.basename, globals()
    write_flags = _WRITE_FLAGS

    def inside(path) -> bool:
        if isinstance(path, int):  # an open descriptor
            return True
        real = realpath(fsdecode(path))  # relative paths resolve against the current directory
        return real == root or real.startswith(root + os.sep)

    def in_proc(path) -> bool:
        """Whether `path` reaches into /proc, by its resolved location (not its text)."""
        if isinstance(path, int) or path is None:
            return False
        full = os.path.abspath(fsdecode(path))
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
        elif event == "open":
            path, mode, flags = args
            if in_proc(path):
                raise PermissionError(f"sandbox: opening {path!r} (under /proc) is not allowed")
            writes = flags & write_flags or (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in ("os.listdir", "os.scandir", "os.chdir") and in_proc(args[0]):
            raise PermissionError(f"sandbox: {event} {args[0]!r} (under /proc) is not allowed")
        elif event in path_events and not all(inside(args[i]) for i in path_events[event]):
            raise PermissionError(f"sandbox: {event} outside the working directory")

    return hook


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[5:] == ["drop-root"])
