"""Escapes from the code sandbox, each tried through every way a program runs: bubblewrap, the
bootstrap's own namespaces (what a machine without bwrap gets), and a `ProgramPool`'s server
(docs/sandbox.md). Where an escape needs native code in the program (which the audit hook cannot
stop), this process stands in for it: `nsenter` runs Python without the hook in the namespaces of
the program's process, as the program's uid."""

import contextlib
import ctypes
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from gppo.rewards import code as sandbox
from gppo.rewards.code import CaseStatus, Limits, run_program
from gppo.rewards.pool import ProgramPool
from tests.test_code_sandbox import runtime_in_tmp

FAST = Limits(timeout_s=5)
HOLD_LIMITS = Limits(timeout_s=30)
_WORKS: dict = {}


@pytest.fixture(scope="module")
def pool():
    with ProgramPool(workers=2) as pool:
        yield pool


@pytest.fixture(params=["bwrap", "namespaces", "pool"])
def run(request, monkeypatch):
    """`run(code, limits) -> ProgramRun` in one of the three ways a program runs; skipped where
    this machine cannot run it that way."""
    if request.param == "bwrap" and sandbox._isolation()[0] != "bwrap":
        pytest.skip("bubblewrap is not installed or cannot make namespaces here")
    if request.param == "pool":
        pool = request.getfixturevalue("pool")
        runner = pool.run
    else:
        if request.param == "namespaces":
            monkeypatch.setattr(sandbox, "_isolation", lambda: ("namespaces", None))
        runner = run_program
    if request.param not in _WORKS:
        probe = runner("print(1)", Limits(timeout_s=10))
        _WORKS[request.param] = probe.stdout == "1\n" and probe.isolation == request.param.replace("pool", "namespaces")
        if request.param == "pool":
            _WORKS[request.param] = _WORKS[request.param] and pool.servers == 2
    if not _WORKS[request.param]:
        pytest.skip(f"programs do not run in {request.param} isolation on this machine")
    return runner


needs_nsenter = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nsenter") is None,
    reason="entering the sandbox's namespaces needs root and nsenter",
)

HOLD = """
import os, time
open({marker!r}, "w").close()
while not os.path.exists({marker!r} + ".release"):
    time.sleep(0.01)
print("released")
"""


def program_pid(marker: str, call) -> int:
    """The pid (here) of the program's process: of the processes whose working directory holds the
    file `marker` (bwrap's own have it too), the one none of the others started."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not call.done():
        found = {}
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                if entry.isdigit() and os.path.exists(f"/proc/{entry}/cwd/{marker}"):
                    found[int(entry)] = status_field(int(entry), "PPid")
        leaves = [pid for pid in found if pid not in found.values()]
        if len(leaves) == 1:
            return leaves[0]
        time.sleep(0.01)
    raise AssertionError(f"the program did not start: {call.result() if call.done() else 'still starting'}")


@contextlib.contextmanager
def held(run, program: str = HOLD, limits: Limits = HOLD_LIMITS):
    """Run `program` (formatted with a fresh `marker`) in the sandbox; yield the pid of its process
    once it has made the file `marker`, and release it (make `marker.release`) after the block."""
    marker = f"held-{uuid.uuid4().hex}"
    with ThreadPoolExecutor(1) as executor:
        call = executor.submit(run, program.format(marker=marker), limits)
        pid = program_pid(marker, call)
        try:
            yield pid
        finally:
            with contextlib.suppress(OSError):
                open(f"/proc/{pid}/cwd/{marker}.release", "w").close()
        result = call.result()
    assert result.status is CaseStatus.PASSED, result


def as_native_code(pid: int, code: str, *namespaces: str, args=()) -> subprocess.CompletedProcess:
    """Run `code` with this interpreter, no audit hook, in `namespaces` of the process `pid`."""
    command = ["nsenter", f"--target={pid}", *namespaces, "--", sys.executable, "-I", "-S", "-c", code, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def status_field(pid: int, name: str) -> int:
    """The first number of a field of /proc/PID/status ("Uid", "PPid")."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{name}:"))


# ---------------------------------------------------------------------------------------------
# IPC and UTS: a namespace of its own for every call

_IPC_CREAT, _IPC_EXCL, _IPC_RMID = 0o1000, 0o2000, 0
SYSV = ctypes.CDLL(None, use_errno=True)

IPC_PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
host_key, own_key = map(int, sys.argv[1:])
keys = [int(line.split()[0]) for name in ("sem", "shm") for line in open("/proc/sysvipc/" + name).readlines()[1:]]
print(json.dumps({
    "semget": libc.semget(host_key, 0, 0) != -1,
    "shmget": libc.shmget(host_key, 0, 0) != -1,
    "listed": host_key in keys,
    "created": libc.semget(own_key, 1, 0o1000 | 0o666) != -1,
}))
"""


@needs_nsenter
def test_sysv_ipc_objects_are_not_shared_with_the_host_or_the_next_call(run, request):
    """A program with native code (it had reached it through /proc/self/mem) saw the host's SysV
    semaphores and left one for a later call: each call needs its own IPC namespace (a pool's server
    keeps one for all its calls, where none can be made, not even by root)."""
    created = request.node.callspec.params["run"] != "pool"
    host_key, own_key = random.sample(range(1 << 20, 1 << 30), 2)
    semaphore = SYSV.semget(host_key, 1, _IPC_CREAT | _IPC_EXCL | 0o600)
    memory = SYSV.shmget(host_key, 4096, _IPC_CREAT | _IPC_EXCL | 0o600)
    assert semaphore != -1 and memory != -1
    try:
        with held(run) as pid:
            probe = as_native_code(pid, IPC_PROBE, "--ipc", args=(host_key, own_key))
            namespaces = {kind: os.readlink(f"/proc/{pid}/ns/{kind}") for kind in ("ipc", "uts")}
        assert probe.returncode == 0, probe.stderr
        assert (
            probe.stdout.strip()
            == f'{{"semget": false, "shmget": false, "listed": false, "created": {str(created).lower()}}}'
        )
        assert all(namespaces[kind] != os.readlink(f"/proc/self/ns/{kind}") for kind in namespaces)
        assert SYSV.semget(own_key, 0, 0) == -1  # not on the host
        with held(run) as pid:
            later = as_native_code(pid, IPC_PROBE, "--ipc", args=(own_key, host_key))
        assert later.stdout.strip().startswith('{"semget": false'), later.stdout + later.stderr  # nor in the next call
    finally:
        SYSV.semctl(semaphore, 0, _IPC_RMID)
        SYSV.shmctl(memory, _IPC_RMID, None)
        leaked = SYSV.semget(own_key, 0, 0)
        if leaked != -1:
            SYSV.semctl(leaked, 0, _IPC_RMID)


# ---------------------------------------------------------------------------------------------
# /proc: read-only, and the audit hook resolves paths relative to directory descriptors


@needs_nsenter
def test_native_code_cannot_write_its_own_memory(run):
    """/proc is mounted read-only: the program's own /proc/self/mem cannot be opened for writing,
    which is how a program got native code running."""
    attempt = (
        "try:\n    open('/proc/self/mem', 'r+b')\n    print('opened')\nexcept OSError as e:\n    print(e.strerror)"
    )
    with held(run) as pid:
        uid = status_field(pid, "Uid")
        namespaces = ("--mount", "--pid", "--root", "--wd", f"--setuid={uid}", f"--setgid={uid}")
        result = as_native_code(pid, attempt, *namespaces)
    assert uid != 0
    assert result.stdout.strip() == "Read-only file system", result.stdout + result.stderr


@pytest.mark.parametrize(
    "attempt",
    [
        "open('/proc/self/mem', 'r+b')",
        "os.open('mem', os.O_RDWR, dir_fd=os.open('/proc/self', os.O_RDONLY))",
        "os.open('proc/self/mem', os.O_RDWR, dir_fd=os.open('/', os.O_RDONLY))",
        "os.mkdir('a')\nos.chdir('a')\nos.open('../proc/self/mem', os.O_RDWR, dir_fd=os.open('/', os.O_RDONLY))",
        "print(os.listdir(os.open('proc', os.O_RDONLY, dir_fd=os.open('/', os.O_RDONLY))))",
        "os.close(os.open('escape', os.O_WRONLY | os.O_CREAT, dir_fd=os.open('/tmp', os.O_RDONLY)))",
        "tmp = os.open('/tmp', os.O_RDONLY)\nopen('escape', 'w', opener=lambda name, flags: os.open(name, flags, dir_fd=tmp))",
        "os.mkdir('escape', dir_fd=os.open('/tmp', os.O_RDONLY))",
        "os.rename('escape', 'escape', dst_dir_fd=os.open('/tmp', os.O_RDONLY))",
    ],
    ids=[
        "proc-mem",
        "proc-self-dir-fd",
        "root-dir-fd",
        "root-dir-fd-up",
        "listdir",
        "write",
        "opener",
        "mkdir",
        "rename",
    ],
)
def test_paths_relative_to_a_directory_descriptor_are_checked(attempt, run):
    """The audit hook resolves a path relative to a directory descriptor where it leads (into /proc,
    or outside the working directory for a write), not against the current directory."""
    result = run(f"import os\nopen('escape', 'w').close()\n{attempt}\nprint('reached')", FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "reached" not in result.stdout, result
    assert result.reason.startswith("PermissionError: sandbox:"), result


def test_legitimate_directory_descriptors_still_work(run):
    program = (
        "import os, shutil\n"
        "os.makedirs('a/b')\n"
        "here = os.open('a', os.O_RDONLY)\n"
        "with open('file', 'w', opener=lambda name, flags: os.open(name, flags, dir_fd=here)) as f:\n"
        "    f.write('x')\n"
        "os.mkdir('c', dir_fd=here)\n"
        "print(sorted(os.listdir(here)), open('a/file').read(), len(os.listdir('/usr')) > 0)\n"
        "shutil.rmtree('a')\n"
        "print(os.path.exists('a'))\n"
    )
    result = run(program, FAST)
    assert result.stdout == "['b', 'c', 'file'] x True\nFalse\n", result


# ---------------------------------------------------------------------------------------------
# Processes: calls running at the same time do not share a limit

HOG = """
import os, threading, time
started = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        started += 1
except RuntimeError:
    pass
open({marker!r}, "w").close()
while not os.path.exists({marker!r} + ".release"):
    time.sleep(0.01)
print("released", started)
"""
THREADS = (
    "import threading\nthreads = [threading.Thread(target=sum, args=([1],)) for _ in range(8)]\n"
    "for t in threads:\n    t.start()\nfor t in threads:\n    t.join()\nprint('ok')\n"
)


def test_a_program_at_its_process_limit_leaves_another_call_its_own(run):
    """RLIMIT_NPROC counts per user: with every call as the same user, a program holding its
    threads made a concurrent call fail ("can't start new thread")."""
    limits = Limits(timeout_s=30, max_processes=16)
    with held(run, HOG, limits):
        sibling = run(THREADS, Limits(timeout_s=10, max_processes=16))
    assert sibling.status is CaseStatus.PASSED and sibling.stdout == "ok\n", sibling


# ---------------------------------------------------------------------------------------------
# The audit hook's other refusals, and the private root, through the pool too


@pytest.mark.parametrize(
    "attempt",
    [
        "import ctypes",
        "import subprocess\nsubprocess.run(['true'])",
        "import socket\nsocket.socket()",
        "import sys\nsys._getframe(1).f_globals",
        "import gc\ngc.get_objects()",
        "os.kill(os.getppid(), 9)",
        "os.symlink('/proc/self/mem', 'link')",
        "open('/proc/self/environ').read()",
        "open('/tmp/escape', 'w')",
        "import _posixsubprocess\n_posixsubprocess.fork_exec(*[None] * 21)",
    ],
    ids=lambda attempt: attempt.split("\n")[-1][:30],
)
def test_the_hook_refuses_in_every_way_a_program_runs(attempt, run):
    result = run(f"import os\n{attempt}\nprint('reached')", FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "reached" not in result.stdout, result


def test_the_private_root_holds_only_the_runtime(run):
    program = (
        "import os, sys\n"
        f"print(os.listdir('.'), sorted(os.listdir('/tmp')) == {runtime_in_tmp()!r}, os.getuid() != 0, "
        "'proc' in os.listdir('/'))\n"
        f"print(os.path.exists({os.path.dirname(os.path.abspath(__file__))!r}), os.path.exists(sys.argv[0]))\n"
    )
    result = run(program, FAST)
    assert result.stdout == "[] True True True\nFalse True\n", result


# ---------------------------------------------------------------------------------------------
# ctypes: no process the program descends from has loaded it

CTYPES_PROBE = """
def walk(cls, seen):
    for sub in type.__subclasses__(cls):
        if sub not in seen:
            seen.add(sub)
            walk(sub, seen)
seen = set()
walk(object, seen)
print(sorted(c.__name__ for c in seen if c.__module__ in ("_ctypes", "ctypes")))
"""


def test_no_ctypes_type_is_within_reach(run):
    """A pool's program process once descended from a process that had imported ctypes: its types
    stayed reachable through `object.__subclasses__()`, and subclasses of `_SimpleCData` and
    `_Pointer` read and wrote memory out of bounds with no audit event."""
    result = run(CTYPES_PROBE, FAST)
    assert (result.status, result.stdout) == (CaseStatus.PASSED, "[]\n"), result


def mapped(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


@needs_nsenter
def test_neither_the_program_nor_the_pools_server_has_ctypes_in_memory(run, request):
    with held(run) as pid:
        images = {"program": mapped(pid)}
        if request.node.callspec.params["run"] == "pool":
            images["server"] = mapped(status_field(pid, "PPid"))
    assert images and all("_ctypes" not in image and "libffi" not in image for image in images.values()), [
        name for name, image in images.items() if "_ctypes" in image
    ]


# ---------------------------------------------------------------------------------------------
# The pool: what a call leaves behind is gone before the next call on its slot

LEAVE = """
import os, threading, time
open("left", "w").close()
os.mkdir("deep")
for _ in range(1500):  # nested deeper than the recursion limit, with short paths
    os.mkdir("above")
    os.rename("deep", "above/deep")
    os.rename("above", "deep")
os.chmod("deep", 0)

def late(name):
    time.sleep(0.3)
    open(name, "w").close()

threading.Thread(target=late, args=("/sandbox/from-a-thread",), daemon=True).start()
if os.fork() == 0:
    late("/sandbox/from-a-child")
    os._exit(0)
print("left")
"""
LOOK = f"import os, time\ntime.sleep(0.6)\nprint(os.listdir('.'), sorted(os.listdir('/tmp')) == {runtime_in_tmp()!r})"


def test_a_pool_call_leaves_nothing_for_the_next_on_its_slot():
    """The server's namespaces serve every call of its slot: after a call, every process of it is
    killed (a forked child, the daemon threads with their process), and /sandbox and /tmp are
    emptied, however deep the program nested its directories."""
    with ProgramPool(workers=1) as pool:
        (server,) = pool._free
        assert pool.run(LEAVE, FAST).stdout == "left\n"
        left = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if status_field(int(entry), "Uid") == server.uid:
                    left.append(int(entry))
        assert left == []
        later = pool.run(LOOK, FAST)
        assert (later.status, later.stdout, pool.servers) == (CaseStatus.PASSED, "[] True\n", 1), later
        if os.geteuid() == 0 and shutil.which("nsenter"):  # /tmp, which only native code can write
            with held(pool.run) as pid:
                uid = status_field(pid, "Uid")
                namespaces = ("--mount", "--root", "--wd", f"--setuid={uid}", f"--setgid={uid}")
                wrote = as_native_code(pid, "open('/tmp/left', 'w').close()\nprint('wrote')", *namespaces)
            assert wrote.stdout == "wrote\n", wrote.stderr
            later = pool.run(LOOK, FAST)
            assert (later.status, later.stdout, pool.servers) == (CaseStatus.PASSED, "[] True\n", 1), later


IPC_CREATE = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
key = int(sys.argv[1])
made = {
    "sem": libc.semget(key, 1, 0o1600),
    "shm": libc.shmget(key, 4096, 0o1600),
    "msg": libc.msgget(key, 0o1600),
    "mq": libc.mq_open(b"/gppo-probe", os.O_CREAT | os.O_RDWR, 0o600, None),
}
print(json.dumps({kind: result != -1 for kind, result in made.items()}))
"""


@needs_nsenter
def test_system_v_ipc_and_message_queues_cannot_be_made_in_the_pool(pool):
    """A pool's server keeps its IPC namespace for all its calls, so none of its programs may make
    an IPC object there that a later call could read."""
    with held(pool.run) as pid:
        uid = status_field(pid, "Uid")
        namespaces = ("--ipc", "--mount", "--root", "--wd", f"--setuid={uid}", f"--setgid={uid}")
        made = as_native_code(pid, IPC_CREATE, *namespaces, args=(1234,))
    assert made.stdout.strip() == '{"sem": false, "shm": false, "msg": false, "mq": false}', made.stdout + made.stderr


@pytest.mark.parametrize(
    "attempt",
    [
        "from multiprocessing import shared_memory\nshared_memory.SharedMemory(create=True, size=16)",
        "import multiprocessing\nmultiprocessing.Lock()",
    ],
    ids=["shared-memory", "semaphore"],
)
def test_shared_memory_and_semaphores_fail_cleanly(attempt, run):
    result = run(f"{attempt}\nprint('reached')", FAST)
    assert result.status is CaseStatus.RUNTIME_ERROR and "reached" not in result.stdout, result
    assert "Error" in result.reason, result
