"""How many CPU threads torch should use: the cores that other work is not already using."""

from __future__ import annotations

import os
import time


def default_threads(window_s: float = 0.1) -> int:
    """CPU threads to use: the cores not already busy (a second thread on a loaded core makes
    small-model steps several times slower, measured on 2-core machines). Busy cores are measured
    from the CPU time spent outside idle over `window_s` (/proc/stat); the load average, used where
    /proc/stat is missing, also counts tasks waiting on I/O, and read 1 on an idle 2-core VM."""
    cores = os.cpu_count() or 1
    try:
        busy = _busy_cores(window_s)
    except OSError:
        busy = os.getloadavg()[0]
    return max(1, cores - round(busy))


def _busy_cores(window_s: float) -> float:
    """Cores busy on average over `window_s`: (1 - idle share of the CPU time) x cores, from the
    aggregate 'cpu' line of /proc/stat (fields user nice system idle iowait ...; idle + iowait idle)."""

    def sample():
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return sum(values), values[3] + values[4]

    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    if total1 <= total0:
        return 0.0
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)
