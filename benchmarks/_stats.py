"""Shared by the benchmarks: percentiles of timings and the host's memory counters."""

from __future__ import annotations

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
