"""gppo.allocator: freed megabyte-sized tensors that glibc's heap kept resident leave the resident
set when the trainer releases them after an update."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim"
)

SCRIPT = """
import torch
from gppo.allocator import release_free_memory
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
x = torch.ones(16 << 18)  # a 16 MiB block freed: glibc raises its mmap threshold above the blocks below
del x
before = rss_mb()
blocks, kept = [], []
for _ in range(200):  # 2 MiB blocks, as activations are, between small tensors that stay (as weights do)
    blocks.append(torch.ones(2 << 18))
    kept.append(torch.ones(256))
del blocks
held = rss_mb() - before
assert release_free_memory()
print(held, rss_mb() - before)
"""


def test_freed_heap_memory_leaves_the_resident_set():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
    held, after = map(float, out.stdout.split())
    assert after < 10, f"{after} MB of the 400 MB freed still resident after release_free_memory (before: {held})"
