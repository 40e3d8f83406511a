"""Freed tensor memory back to the OS: glibc's mmap threshold, fixed (Linux).

glibc serves an allocation below its mmap threshold from heaps that it seldom returns to the OS,
and raises the threshold (up to 32 MiB) whenever a larger mmapped block is freed. A training step
allocates and frees megabyte-sized activations in every micro-batch; once the threshold has risen
they come from the heap, and the freed space stays resident. On the README quickstart
(SmolLM2-135M) the update then ended holding 4.7 GB of RSS, of which 2.1 GB was free memory, and
peaked at 5.2 GB; with the threshold fixed at 1 MiB it ends at 2.9 GB and peaks at 4.7 GB
(docs/results.md §8c). A fixed threshold also turns glibc's raising off. Tensors of 1 MiB or more
are then mapped and unmapped: a page fault per page touched, negligible beside the arithmetic that
fills them.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory_to_os() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process; False where it does not apply
    (not Linux, not glibc) or where MALLOC_MMAP_THRESHOLD_ already sets it (the user's choice wins)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library this process runs on
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
