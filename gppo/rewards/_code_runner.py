"""The trusted side of `gppo.rewards.code` (design and threat model: docs/sandbox.md).

Run as `python -I -B -S _code_runner.py CONFIG_FD STATUS_FD`; standard library only. This bootstrap
starts the program's process (`_code_child.py`) in a private root: through bubblewrap where the
caller chose it, else through namespaces and mounts set up here, else (no namespaces) in the
caller's temporary directory on the host's filesystem. It then judges through the channel to
that process: a call test calls the function, an assert test runs here with the program's names
as proxies, and a stdin/stdout test only waits. It reports on STATUS_FD, which the program's
process never holds, and kills and reaps everything the program left behind.

Run as `python -I -B -S _code_runner.py serve SOCKET_FD CONFIG`, it starts one slot of a
`ProgramPool`: the namespaces and private root above, made once, in which a fresh interpreter runs
the slot's server (`_code_server.py`), which forks a program's process per call.
"""

import builtins
import json
import os
import signal
import stat
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _code_child  # noqa: E402  (this directory is on sys.path only for these imports)
import _wire  # noqa: E402

del sys.path[0]

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x20000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
_MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 0x1000, 0x4000, 0x40000, 0x200000
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36

# What the private root holds, besides the interpreter's prefixes: system programs' libraries
# (read-only), a few devices, the harness files, /proc, and two empty tmpfs.
_SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEVICE_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
_HARNESS_FILES = ("_wire.py", "_code_child.py", "_code_server.py")
_WORKDIR, _WIRE_DIR = "/sandbox", "/harness"  # inside the private root
_TMPFS = ((_WORKDIR, "0777"), ("/tmp", "1777"))  # empty, writable by the program: (mount point, mode)
_TMPFS_BYTES, _TMPFS_INODES = 64 << 20, 16384  # each; the inodes bound what a pool's server has to remove
# A pool's server keeps its IPC namespace for all its calls, so nothing of System V IPC or POSIX
# message queues can be made there (the limits of the namespace, written in its /proc).
_IPC_DISABLED = (
    ("kernel/shmmni", "0"),
    ("kernel/msgmni", "0"),
    ("kernel/sem", "0 0 0 0"),
    ("fs/mqueue/queues_max", "0"),
)


def _bootstrap(config_fd: int, status_fd: int) -> None:
    """Start the program, judge it, enforce the wall clock, kill and reap, report."""
    import ctypes  # a local name of the trusted process; the program's process never has it

    with open(config_fd, "rb") as f:
        config = json.loads(f.read())
    sys.path += config["site_packages"]  # started with -S: for the imports of assert tests
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the program come back to us
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    isolation, pid = _start(config, libc, (request_r, reply_w), status_fd)
    os.close(request_r)
    os.close(reply_w)
    deadline = _Deadline(pid, config["timeout_s"])
    channel = _Channel(request_w, reply_r, config["max_output_bytes"])
    outcome = None
    try:
        if channel.receive() == {"ready": True}:  # the sandboxed interpreter started
            _wire.record(status_fd, {"setup": {"isolation": isolation}})
            channel.send({"kind": config["kind"], "source": config["source"]})
            outcome = _judge(config, channel)
    except (_wire.ChannelClosed, OSError):
        pass  # no "ready": the caller reports the sandbox's failure with its stderr
    finally:
        stopped = config["kind"] != "stdio" and _alive(pid)
        if stopped:
            _kill(pid)  # judged: the program's process has nothing left to do
        code = deadline.wait()
        _reap_orphans()
    if isolation == "bwrap" and code > 128:  # bwrap reports a signal as 128 + its number
        code = 128 - code
    code = None if stopped else code  # None: it was still serving when the judge was done
    _wire.record(status_fd, {"outcome": outcome, "exit": {"code": code, "timed_out": deadline.timed_out}})


# ---------------------------------------------------------------------------------------------
# Starting the program's process


def _start(config: dict, libc, fds: tuple[int, int], status_fd: int) -> tuple[str, int]:
    """Fork the process that becomes the program's (through bwrap, or set up here, then exec'd:
    none of this process's memory stays with it); returns (isolation, its pid)."""
    env = _sandbox_env(config)
    uid = config["uid"] if os.geteuid() == 0 else None  # as root, the caller chose one for this call
    bwrap = config["isolation"] == "bwrap"
    namespaces = not bwrap and config["isolation"] == "namespaces" and _enter_namespaces(libc)
    uid = uid if bwrap or namespaces or not _unreachable_dirs(config["prefixes"]) else None
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            os.setpgid(0, 0)
            for fd in fds:
                os.set_inheritable(fd, True)
            if bwrap:  # it drops root in the program's process, after its own setup
                _code_child.set_limits(config)
                command = _bwrap_command(config, fds, uid)
                os.execve(command[0], command, env)
            wire_dir = _HARNESS_DIR
            if namespaces:
                _private_root(libc, config["prefixes"], os.getcwd(), disable_ipc=False)
                wire_dir = _WIRE_DIR
            else:
                env.update(HOME=os.getcwd(), TMPDIR=os.getcwd())
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
            _code_child.set_limits(config)
            os.execve(
                sys.executable,
                [
                    sys.executable,
                    "-I",
                    "-B",
                    "-S",
                    os.path.join(wire_dir, "_code_child.py"),
                    *_child_arguments(config, fds, None),
                ],
                env,
            )
        except BaseException:  # noqa: BLE001  (no "ready" follows: the caller shows this)
            import traceback

            traceback.print_exc()
        os._exit(70)
    return "bwrap" if bwrap else "namespaces" if namespaces else "guard", pid


def _sandbox_env(config: dict) -> dict:
    """The program's environment: its home and temporary directory are its working directory."""
    return {**config["env"], "HOME": _WORKDIR, "TMPDIR": _WORKDIR}


def _enter_namespaces(libc) -> bool:
    flags = _CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    if _unshare(libc, flags):
        return True
    uid, gid = os.getuid(), os.getgid()
    if not _unshare(libc, _CLONE_NEWUSER | flags):
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _unshare(libc, flags: int) -> bool:
    if hasattr(os, "unshare"):  # Python 3.12+
        try:
            os.unshare(flags)
            return True
        except OSError:
            return False
    return libc.unshare(flags) == 0


def _runtime_paths(prefixes: list[str]) -> list[str]:
    """Host paths the private root shows read-only: the interpreter's prefixes (a venv and its
    base), its executable, and the system's libraries; none inside another."""
    paths = {p for p in _SYSTEM_PATHS if os.path.lexists(p)}
    for path in prefixes:
        paths |= {os.path.abspath(path), os.path.realpath(path)}
    paths.add(os.path.realpath(sys.executable))
    directories = [q for q in paths if not os.path.islink(q)]
    return sorted(p for p in paths if not any(p.startswith(q + os.sep) for q in directories))


def _runtime_entries(directory: str, prefixes: list[str]) -> list[str]:
    """The names in `directory` (a tmpfs of the private root) that lead to runtime paths bound below
    it (a venv under /tmp): root's, which a program cannot change, and kept when it is emptied."""
    return sorted(
        {p[len(directory) + 1 :].split(os.sep)[0] for p in _runtime_paths(prefixes) if p.startswith(directory + os.sep)}
    )


def _bwrap_command(config: dict, fds: tuple[int, int], uid: int | None) -> list[str]:
    """The same private root as `_private_root`, built by bubblewrap, in the same order."""
    command = [
        config["bwrap"],
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
    ]
    for directory, mode in _TMPFS:  # bwrap has no option for a tmpfs's inodes
        command += ["--size", str(_TMPFS_BYTES), "--perms", mode, "--tmpfs", directory]
    paths = _runtime_paths(config["prefixes"])
    bound = [p for p in paths if not os.path.islink(p)] + [f"{_WIRE_DIR}/{_HARNESS_FILES[0]}"]
    made = {directory for directory, _ in _TMPFS}
    for directory in sorted({a for p in bound for a in _ancestors(p)} - made):  # else bwrap makes them 0700
        command += ["--perms", "0755", "--dir", directory]
    for path in paths:
        command += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
    for name in _HARNESS_FILES:
        command += ["--ro-bind", os.path.join(_HARNESS_DIR, name), f"{_WIRE_DIR}/{name}"]
    command += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--remount-ro",
        "/proc",
        "--remount-ro",
        "/",
        "--chdir",
        _WORKDIR,
        "--",
        sys.executable,
        "-I",
        "-B",
        "-S",
        f"{_WIRE_DIR}/_code_child.py",
    ]
    return command + _child_arguments(config, fds, uid)


def _child_arguments(config: dict, fds: tuple[int, int], uid: int | None) -> list[str]:
    """`_code_child.py`'s arguments: the channel, the site-packages, and the uid to become."""
    arguments = [str(fds[0]), str(fds[1]), os.pathsep.join(config["site_packages"])]
    return arguments + ([str(uid)] if uid is not None else [])


def _ancestors(path: str) -> list[str]:
    """The directories above `path`, without "/"."""
    parts = path.rstrip("/").split("/")
    return ["/".join(parts[:i]) for i in range(2, len(parts))]


def _private_root(libc, prefixes: list[str], mount_point: str, disable_ipc: bool) -> None:
    """Build the private root on a tmpfs at `mount_point` (the caller's fresh temporary
    directory, in this mount namespace only) and chroot into its working directory. Its empty
    tmpfs come first and the host's paths are bound after, into them where they lie below (a venv
    under /tmp): nothing of the host is ever covered, so no source can become unreachable. With
    `disable_ipc` (a pool's server), /proc must mount, and System V IPC and POSIX message queues
    are switched off in this IPC namespace through it before it becomes read-only."""
    _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE)
    os.umask(0o022)
    root = mount_point
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=755")
    for directory, mode in _TMPFS:
        os.mkdir(root + directory)
        options = f"size={_TMPFS_BYTES},nr_inodes={_TMPFS_INODES},mode={mode}"
        _mount(libc, "tmpfs", root + directory, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    for path in _runtime_paths(prefixes):
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        else:
            _bind(libc, path, root + path, read_only=True)
    for name in _HARNESS_FILES:
        _bind(libc, os.path.join(_HARNESS_DIR, name), f"{root}{_WIRE_DIR}/{name}", read_only=True)
    for device in _DEVICES:
        _bind(libc, device, root + device, read_only=False)
    for link, target in _DEVICE_LINKS.items():
        os.symlink(target, root + link)
    os.mkdir(root + "/proc")
    proc_flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        _mount(libc, "proc", root + "/proc", "proc", proc_flags | (0 if disable_ipc else _MS_RDONLY))
    except OSError:
        if disable_ipc:
            raise
        # else refused where the host's /proc is partly masked (containers): no /proc inside then
    else:
        if disable_ipc:
            for name, value in _IPC_DISABLED:
                with open(f"{root}/proc/sys/{name}", "w") as f:
                    f.write(value)
            _mount(libc, None, root + "/proc", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | proc_flags)
    _mount(libc, None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(root)
    os.chroot(".")
    os.chdir(_WORKDIR)


def _bind(libc, source: str, target: str, read_only: bool) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)
    if read_only:  # keeping the flags the source's mount has (a user namespace may not drop them)
        kept = os.statvfs(source).f_flag & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | 1024 | 2048)
        kept |= _MS_RELATIME if os.statvfs(source).f_flag & 4096 else 0
        _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | kept)


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, options: str | None = None) -> None:
    src, dst, kind, opts = (None if s is None else s.encode() for s in (source, target, fstype, options))
    if libc.mount(src, dst, kind, flags, opts) != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _closed_ancestor(path: str) -> str | None:
    """The first directory on the way to `path` that others may not enter, if any."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        ancestor = os.sep.join(parts[:i])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _unreachable_dirs(prefixes: list[str]) -> list[str]:
    """Interpreter directories `nobody` cannot enter (without a private root, root stays root)."""
    return [a for a in (_closed_ancestor(os.path.realpath(p)) for p in prefixes) if a]


class _Deadline:
    """The wall clock: SIGALRM kills the program's process at the deadline, interrupting whatever
    this process waits for (no thread: none can start after unshare(CLONE_NEWPID))."""

    def __init__(self, pid: int, timeout_s: float):
        self.pid, self.timed_out = pid, False
        signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)

    def _expire(self, signum, frame) -> None:
        self.timed_out = True
        _kill(self.pid)

    def wait(self) -> int:
        """Wait for the program's process; its exit status (negative: killed by that signal)."""
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        signal.setitimer(signal.ITIMER_REAL, 0)
        _kill(self.pid)  # its group: still a zombie, so the group id cannot have been reused
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def _alive(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def _kill(pid: int) -> None:
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------------------------------
# Judging (trusted: the program's process never sees the tests)


class ProgramFailure(BaseException):
    """The program's process ended, sent something that is not a message or not plain data, or
    exited: the test cannot pass. A BaseException, so that no `except Exception` in a test
    swallows it."""


class _Channel:
    def __init__(self, request_fd: int, reply_fd: int, limit: int):
        self.request_fd, self.reply_fd, self.limit = request_fd, reply_fd, limit
        self.failure: str | None = None  # once set, every later call fails too

    def send(self, message: dict) -> None:
        _wire.send(self.request_fd, message)

    def receive(self) -> dict:
        return _wire.receive(self.reply_fd, self.limit)

    def fail(self, reason: str) -> ProgramFailure:
        self.failure = self.failure or reason
        return ProgramFailure(self.failure)

    def call(self, target: list, args: tuple, kwargs: dict):
        """Call `target` in the program's process with arguments by value; a plain result, or a
        `_Remote` for a new object of the program's class."""
        if self.failure:
            raise ProgramFailure(self.failure)
        try:
            self.send({"call": target, "args": _wire.tag(list(args)), "kwargs": _wire.tag(dict(kwargs))})
            reply = self.receive()
        except _wire.NotPlain as e:
            raise TypeError(f"the test passed something that is not plain data to the program: {e}") from None
        except (_wire.ChannelClosed, OSError) as e:
            raise self.fail(f"the program's process ended during a call ({e})") from None
        name = ".".join(map(str, target))
        if "value" in reply:
            try:
                return _wire.untag(reply["value"])
            except _wire.NotPlain as e:
                raise self.fail(f"{name} returned {e}") from None
        if "handle" in reply and type(reply["handle"]) is int:
            return _Remote(self, [reply["handle"]], f"{name}()")
        if "refused" in reply:
            raise self.fail(str(reply["refused"])[:300])
        raised = reply.get("raised")
        if type(raised) is list and len(raised) == 2 and all(type(x) is str for x in raised):
            error = getattr(builtins, raised[0], None)
            if isinstance(error, type) and issubclass(error, Exception):  # a test may expect it
                raise error(raised[1])
            raise self.fail(f"{name} raised {raised[0]}: {raised[1]}")
        raise self.fail(f"{name}: the program's process sent a malformed reply")


class _Remote:
    """A name, attribute or object of the program, for the test: calling it calls the program
    through the channel. It has no value here: comparing it or asking its truth raises."""

    __slots__ = ("_channel", "_target", "_name")

    def __init__(self, channel: _Channel, target: list, name: str):
        self._channel, self._target, self._name = channel, target, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._target, args, kwargs)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Remote(self._channel, self._target + [attribute], f"{self._name}.{attribute}")

    def __repr__(self) -> str:
        return f"<the program's {self._name}>"

    def _no_value(self, *args):
        raise TypeError(f"{self._name} is an object of the program, not plain data: tests compare plain values")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = __iter__ = _no_value
    __hash__ = object.__hash__


def _judge(config: dict, channel: _Channel) -> dict | None:
    """The outcome: None for stdin/stdout (the caller judges the output), else `{"value": ...}`
    (call tests; compared by the caller), `{"passed": true}` or `{"error", "message"}`."""
    if config["kind"] == "stdio":
        return None
    try:
        reply = channel.receive()
    except _wire.ChannelClosed as e:
        return {"error": "ProgramFailure", "message": f"the program's process ended while loading ({e})"}
    if type(reply.get("names")) is not dict:
        raised = reply.get("raised")
        if type(raised) is list and len(raised) == 2:
            return {"error": str(raised[0]), "message": str(raised[1])[:300]}
        return {"error": "ProgramFailure", "message": "the program's process sent a malformed reply"}
    names = reply["names"]
    try:
        if config["kind"] == "call":
            return {"value": _wire.tag(_call_test(channel, names, config["fn_name"], config["args"]))}
        _assert_test(channel, names, config["test_code"])
        return {"passed": True}
    except BaseException as error:  # noqa: BLE001  (the test's failure is the outcome)
        return {"error": type(error).__name__, "message": str(error)[:300]}


def _call_test(channel: _Channel, names: dict, fn_name: str, args: list):
    if fn_name in names:
        return channel.call([fn_name], tuple(args), {})
    if "Solution" in names:
        solution = channel.call(["Solution"], (), {})
        if isinstance(solution, _Remote):
            return getattr(solution, fn_name)(*args)
    raise NameError(f"the program defines no function {fn_name!r} (nor Solution.{fn_name})")


def _assert_test(channel: _Channel, names: dict, test_code: str) -> None:
    """Run the test here, in a namespace of the prelude's names, then the program's own names
    (not those that would shadow a builtin or the prelude): plain values by value, the rest as
    `_Remote` proxies. Passes if the test ran to its end and no call failed."""
    namespace: dict = {"__name__": "solution", "__builtins__": builtins}
    exec(_wire.PRELUDE, namespace)
    hidden = set(namespace) | set(vars(builtins))
    for name, value in names.items():
        if type(name) is str and name not in hidden:
            namespace[name] = _Remote(channel, [name], name) if value is None else _wire.untag(value)
    exec(compile(test_code, "test.py", "exec", dont_inherit=True), namespace)
    if channel.failure:  # a failed call that the test caught
        raise ProgramFailure(channel.failure)


def _reap_orphans(wait_s: float = 1.0) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
        except ChildProcessError:
            return


# ---------------------------------------------------------------------------------------------
# A pool's server


def _serve(socket_fd: int, config: dict) -> None:
    """Start one slot of a `ProgramPool` (docs/sandbox.md, "The pool"): its namespaces and private
    root, made once, then, as the first process of its PID namespace, a fresh interpreter running
    `_code_server.py` on the socket, so that none of this process's memory (its `ctypes`) reaches
    the programs. Waits for it: the caller's process is this one, and ending it ends the server."""
    import ctypes  # a local name of the trusted process; the server and its programs never have it

    libc = ctypes.CDLL(None, use_errno=True)
    if not _enter_namespaces(libc):
        raise RuntimeError("a pool's server runs programs only in namespaces, and none could be made here")
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _private_root(libc, config["prefixes"], os.getcwd(), disable_ipc=True)
            served = {
                "uid": config["uid"] if os.geteuid() == 0 else None,
                "site_packages": config["site_packages"],
                "emptied": {directory: _runtime_entries(directory, config["prefixes"]) for directory, _ in _TMPFS},
            }
            server = [sys.executable, "-I", "-B", "-S", f"{_WIRE_DIR}/_code_server.py", str(socket_fd)]
            os.execve(sys.executable, server + [json.dumps(served)], _sandbox_env(config))
        except BaseException:  # noqa: BLE001  (the caller shows this)
            import traceback

            traceback.print_exc()
        os._exit(70)
    os.close(socket_fd)  # the server's alone: the caller sees its end
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) & 0xFF)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        _bootstrap(int(sys.argv[1]), int(sys.argv[2]))
