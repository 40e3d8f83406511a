"""`ProgramPool`: the code sandbox's pre-started servers, for tool calls at a few milliseconds each
(design: docs/sandbox.md, "The pool"). A call returns what `gppo.rewards.code.run_program` returns
for the same program; the sandbox's settings, call files and uids are `gppo.rewards.code`'s, read
from that module when used (so that what a test sets there holds here too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from gppo.rewards import code as sandbox
from gppo.rewards.code import Limits, ProgramRun, SandboxError, StdioTest, run_program

_START_S = 30.0  # for a pool's server to make its namespaces and start


class ProgramPool:
    """Runs programs as `run_program` does, with the same isolation, at a fixed cost of a few
    milliseconds instead of two interpreters' start-up (docs/sandbox.md, "The pool").

    `workers` servers, one per slot, each started once in namespaces of its own (PID, mount,
    network, IPC with System V IPC and message queues switched off, UTS) and a private root with a
    read-only /proc, as a fresh interpreter; a call forks the program's process there, as its slot's
    uid (as root), with the limits and the audit hook, and after it every other process of the
    namespace is killed and the writable directories are emptied.
    `run` is thread-safe: up to `workers` calls run at once; more wait for a free slot. Where a
    server cannot run programs (no namespaces here), its calls fall back to `run_program`, with a
    warning. Close it (`close`, or use it as a context manager) to end the servers; a pool does not
    survive `fork`."""

    def __init__(self, workers: int = 4):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"ProgramPool: workers must be a positive int, got {workers!r}")
        self._directory = tempfile.mkdtemp(prefix="gppo-pool-")  # the servers' mount point: stays empty
        self._changed = threading.Condition()
        self._free: list[_Server | None] = []  # None: a slot whose calls go to run_program
        self._size = self._fallen = 0  # slots, and those whose server failed
        self._closed = self._warned = False
        try:
            for _ in range(workers):
                self._free.append(self._start_server())
                self._size += 1
        except BaseException:
            self.close()
            raise

    @property
    def servers(self) -> int:
        """How many slots have a server (the others' calls go to `run_program`)."""
        return self._size - self._fallen

    def run(self, code: str, limits: Limits = Limits()) -> ProgramRun:
        """`run_program(code, limits)`, in a free slot (waiting for one)."""
        with self._changed:
            self._changed.wait_for(lambda: self._free or self._closed)
            if self._closed:
                raise RuntimeError("ProgramPool.run: the pool is closed")
            server = self._free.pop()
        try:
            if server is not None:
                try:
                    return self._run_in(server, code, limits)
                except (OSError, SandboxError) as error:  # the server failed, not the program: run it again
                    server.close()
                    server = None
                    self._fall_back(error)
            return run_program(code, limits)
        finally:
            with self._changed:
                self._free.append(server)
                self._changed.notify_all()

    def close(self) -> None:
        """Wait for the calls running, then end the servers; later calls raise."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            self._changed.wait_for(lambda: len(self._free) == self._size)
            servers, self._free, self._size = self._free, [], 0
        for server in servers:
            if server is not None:
                server.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> ProgramPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_server(self) -> _Server | None:
        try:
            if os.geteuid() != 0:
                raise OSError(
                    "not root: in a user namespace a forked program would keep the capabilities that made it "
                    "(only an exec drops them); run as root for the pool"
                )
            return _Server(self._directory)
        except OSError as error:
            self._fall_back(error)
            return None

    def _fall_back(self, error: BaseException) -> None:
        with self._changed:
            self._fallen += 1
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(
                f"ProgramPool: a sandbox server could not run programs ({str(error)[:300]}); its calls run "
                "with run_program instead",
                RuntimeWarning,
                stacklevel=3,
            )

    def _run_in(self, server: _Server, code: str, limits: Limits) -> ProgramRun:
        test = StdioTest("", "")
        with sandbox._call_files({"source": code}, test, self._directory) as files:  # the server never reads it
            start = time.monotonic()
            server.call(files, limits)
            return sandbox._program_output(test, files, limits, False, time.monotonic() - start)


class _Server:
    """One slot of a `ProgramPool`: a server (started by `_code_runner.py serve`, running
    `_code_server.py` in its own namespaces) on one end of a socket, and the uid its programs run as
    (as root; held while the server lives). `OSError` when it cannot start."""

    def __init__(self, directory: str):
        self._held = contextlib.ExitStack()
        self.uid = self._held.enter_context(sandbox._program_uid())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = self._held.enter_context(ours)
        self._errors = self._held.enter_context(tempfile.TemporaryFile())  # why it could not start
        config = json.dumps({"uid": self.uid, "env": sandbox._ENV, **sandbox._runtime()})
        with theirs:
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-S", sandbox._RUNNER, "serve", str(theirs.fileno()), config],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=self._errors,
                    pass_fds=(theirs.fileno(),),
                    cwd=directory,
                    env=sandbox._ENV,
                    start_new_session=True,
                )
            except BaseException:
                self._held.close()
                raise
        self._socket.settimeout(_START_S)
        try:
            started = self._socket.recv(16) == b"ready"
        except OSError:
            started = False
        if not started:
            self._errors.seek(0)
            errors = self._errors.read()[-300:].decode(errors="replace").strip()
            self.close()
            raise OSError(f"the sandbox server did not start: {errors or 'no answer'}")

    def call(self, files: dict, limits: Limits) -> None:
        """Run the call the files describe (the server writes its outcome to the status file)."""
        fds = [files[name].fileno() for name in ("config", "status", "stdin", "stdout", "stderr")]
        socket.send_fds(self._socket, [json.dumps(dataclasses.asdict(limits)).encode()], fds)
        self._socket.settimeout(limits.timeout_s + sandbox._GRACE_S)  # past the server's own wall clock: it is stuck
        if not self._socket.recv(16):
            raise OSError(f"the sandbox server ended (exit status {self._process.poll()})")

    def close(self) -> None:
        self._socket.close()  # the server reads the end of its socket and exits
        try:
            self._process.wait(timeout=sandbox._GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._held.close()
