"""Shared by the benchmarks: percentiles of timings, the host's memory counters, processes'
CPU time and the host's speed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path


def pct(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0–100) of ``values`` by nearest rank (no interpolation: a
    reported p99 is a time some sandbox really took)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":")
        out[key] = int(value.split()[0]) * 1024
    return out


def process_cpu(pids: Iterable[int]) -> float:
    """CPU-seconds (user + system) the processes ``pids`` have used so far (0 for one gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            # after the command's ")": the fields from the third on; utime, stime are 14, 15
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def host_speed() -> str:
    """One line on the host, so figures from different machines can be compared: its cores
    and how long this Python takes for a 10^7-iteration loop (the lazy path's daemon is
    bound by it; on a host half as fast ``cold_start``'s lazy total was 0.65-0.87 of full's,
    against 0.57-0.70 here)."""
    t = time.perf_counter()
    for _ in range(10 ** 7):
        pass
    loop = time.perf_counter() - t
    return (f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} (1 min), a 10^7-iteration "
            f"Python loop {loop:.2f} s")
