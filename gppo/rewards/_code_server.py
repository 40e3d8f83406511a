"""A `ProgramPool`'s server, inside the private root its starter made (design: docs/sandbox.md,
"The pool").

Run as `python -I -B -S /harness/_code_server.py SOCKET_FD CONFIG` by `_code_runner.py serve`, as
the first process of the server's PID namespace, with the working directory its programs get. A
fresh interpreter, so that nothing of the starter (its `ctypes`, whose types a program could reach
through `object.__subclasses__()` and use to read or write memory unaudited) is in this process or
in the program's processes it forks. It holds nothing secret: no test, no expected output, and no
program (each call's process reads its own). For each request on the socket (a call's limits, and
its program, status, stdin, stdout and stderr descriptors) it forks the program's process, enforces
the wall clock, kills every other process of the namespace, reaps them, empties the writable
directories, and writes the exit status to the status file, as the bootstrap does for `run_program`.
"""

import gc
import json
import os
import signal
import socket
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _code_child  # noqa: E402  (this directory is on sys.path only for these imports)
import _wire  # noqa: E402

del sys.path[0]

_timed_out = False


def serve(server: socket.socket, config: dict) -> None:
    """Answer requests until the caller closes its end of the socket. `config`: the uid programs run
    as (None: this one), the site-packages, and the writable directories to empty after each call,
    each with the names in it to keep."""
    __import__("_posixsubprocess")  # what every program's process would otherwise import
    signal.signal(signal.SIGALRM, _expire)
    gc.freeze()  # the forks' collections then skip (and copy) none of this process's objects
    server.send(b"ready")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(server, 1024, 5)
        except OSError:
            return
        if not message or len(fds) != 5:
            return  # the pool was closed (or sent something else: the caller is gone)
        _call(json.loads(message), fds, config)
        try:
            server.send(b"done")
        except OSError:
            return  # the caller is gone


def _call(limits: dict, fds: list[int], config: dict) -> None:
    global _timed_out
    source_fd, status_fd, *streams = fds
    ready_r, ready_w = os.pipe()
    workdir = os.getcwd()
    pid = os.fork()
    if pid == 0:
        _program(config, limits, source_fd, streams, ready_w, workdir)
    for fd in (source_fd, *streams, ready_w):
        os.close(fd)
    _timed_out = False
    signal.setitimer(signal.ITIMER_REAL, limits["timeout_s"])
    try:
        if os.read(ready_r, 1) == b"1":  # before any program code runs
            _wire.record(status_fd, {"setup": {"isolation": "namespaces"}})
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.close(ready_r)
    _end_processes()
    for directory, kept in config["emptied"].items():
        _empty(directory, set(kept))
    _wire.record(status_fd, {"outcome": None, "exit": {"code": code, "timed_out": _timed_out}})
    os.close(status_fd)


def _expire(signum, frame) -> None:
    global _timed_out
    _timed_out = True
    _kill_others()


def _kill_others() -> None:
    """From the first process of a PID namespace, kill(-1) reaches every other process in it."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass  # there is none


def _end_processes() -> None:
    """Kill and reap everything the program left (its orphans come back to this process)."""
    while True:
        _kill_others()
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _empty(directory: str, kept: set[str]) -> None:
    """Remove everything in `directory` but the `kept` names (root's: the runtime bound below it),
    following no link: each directory's entries are moved up into `directory` before it is removed,
    so that no depth of nesting needs a deeper stack or more descriptors. Any failure ends the
    server (its slot falls back to `run_program`)."""
    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    moved = 0
    try:
        while entries := [entry for entry in os.scandir(top) if entry.name not in kept]:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=top)
                    continue
                inner = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    for child in os.scandir(inner):
                        moved += 1
                        while _exists(f".{moved}", top):
                            moved += 1
                        os.rename(child.name, f".{moved}", src_dir_fd=inner, dst_dir_fd=top)
                finally:
                    os.close(inner)
                os.rmdir(entry.name, dir_fd=top)
    finally:
        os.close(top)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _program(config: dict, limits: dict, source_fd: int, streams: list[int], ready_w: int, workdir: str) -> None:
    """In the fork: become the program's process (its streams, group, uid and limits; no other
    descriptor), say so on `ready_w`, and run the program; never returns."""
    try:
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
        keep = sorted({0, 1, 2, source_fd, ready_w})
        for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        os.setpgid(0, 0)
        os.chdir(workdir)
        if config["uid"] is not None:
            os.setgroups([])
            os.setgid(config["uid"])
            os.setuid(config["uid"])
        _code_child.set_limits(limits)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        with open(source_fd, "rb") as f:
            source = json.loads(f.read())["source"]
        sys.argv = [_code_child.__file__]
        os.write(ready_w, b"1")
        os.close(ready_w)
    except BaseException:  # noqa: BLE001  (no "ready" follows: the caller shows this)
        traceback.print_exc()
        os._exit(70)
    _code_child.main_in_process(source, config["site_packages"])


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), json.loads(sys.argv[2]))
