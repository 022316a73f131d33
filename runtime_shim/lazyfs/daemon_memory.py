"""The node daemon's memory: GC and GIL settings, malloc, heap release, the trees' budget.

Its GIL switch interval and cyclic-GC settings (and what the collections cost), glibc's malloc
kept from handing freed buffers back, the heap settled after a mount's tree is built and
released after an unmount, and the budget every mounted layer's tree is charged against
(``_TreeBudget``: a mount past it is refused)."""

from __future__ import annotations

import contextlib
import os
import threading

from envbuild.libc import LIBC

#: The daemon's GIL switch interval (CPython's default is 5 ms). A miss is a chain of thread
#: hand-offs (FUSE reader, open worker, fetch, reply) while other threads decompress and
#: verify windows and readahead in pure Python; each hand-off can wait a whole interval for
#: the GIL, and a program's first command is a dozen misses one after the other.
SWITCH_INTERVAL = 0.0005
#: The daemon's cyclic-GC generation-0 threshold (CPython's default is 700). Each collection
#: holds the GIL, stopping every FUSE reply; with 700, a cold_start workload ran ~110 of them
#: (up to 27 ms each) and a full one (57 ms) over the mounts' trees.
GC_GEN0_THRESHOLD = 20_000
#: glibc malloc settings for the daemon (``tune_malloc``). Every fetched byte passes through
#: freshly allocated buffers (each response body, each frame's decompressed bytes, a file's
#: joined contents) on one of the daemon's dozens of threads; glibc gives each thread that
#: allocates its own arena (up to 8 per CPU), each arena's heap grows and is trimmed on its
#: own, so memory freed on one thread was not reused by the next and new buffers were new
#: pages, faulted in and zeroed (``perf record -g`` of the daemon in a cold_start lazy run:
#: 20 % of its samples in ``clear_page_erms``, from ZSTD's output and memmove). Measured per
#: lazy run (``cold_start.py --modes lazy --repeat 1``, 1gbit:10ms), the daemon's minor
#: faults: 100-113 k by default, ~102 k with one arena alone or the thresholds alone, 75-88 k
#: with both; sets of ``--modes full,lazy --repeat 3``: total 0.81-0.83 of full against
#: 0.91-1.05 (docs/notes/lazy-loading-log.md, tenth pass). The threads allocate under the GIL anyway,
#: so the one arena's lock costs little.
MALLOC_ARENA_MAX = 1
MALLOC_MMAP_THRESHOLD = 32 << 20    # glibc's maximum on 64-bit: buffers up to this from the heap
MALLOC_TRIM_THRESHOLD = 256 << 20   # give memory back only when this much is free at the top
MALLOC_TOP_PAD = 64 << 20           # and grow the heap by this much at a time
#: glibc's own environment names for these: an operator who sets one keeps glibc's reading
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_TOP_PAD_")
#: What a layer's tree costs the daemon per TOC member (``tree.Node``, its path, the tables
#: that index it): measured 1.56 KB on a 190,000-member layer of short names.
TREE_BYTES_PER_ENTRY = 1600
#: The default of ``--tree-budget``/``$ENVBUILD_LAZY_TREE_BUDGET``: the memory all mounted
#: layers' trees may take (~1.3 million members: five layers of the TOC's largest size).
DEFAULT_TREE_BUDGET = 2 << 30
TREE_BUDGET_ENV = "ENVBUILD_LAZY_TREE_BUDGET"
#: Seconds after a mount's end before its tree's memory is given back (the work it started —
#: an import index read, a prefetch — holds the tree until it is done).
HEAP_RELEASE_DELAY = 1.0


class _GcPauses:
    """The daemon's cyclic-GC settings and what its collections cost (the ping's ``gc``):
    every collection holds the GIL, so its time is time no FUSE request is answered."""

    def __init__(self) -> None:
        self.collections = 0
        self.seconds = 0.0
        self.longest = 0.0
        self._t0 = 0.0

    def install(self) -> None:
        import gc

        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        import time

        # called with the GIL held, one collection at a time: no lock needed
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.collections += 1
        self.seconds += took
        self.longest = max(self.longest, took)

    def snapshot(self) -> dict[str, float]:
        return {"collections": self.collections, "seconds": round(self.seconds, 4),
                "longest_s": round(self.longest, 4)}


_GC_PAUSES = _GcPauses()


def tune_malloc() -> str:
    """Keep the daemon's freed buffers for reuse (``MALLOC_*`` above) with glibc's
    ``mallopt``; returns what was done, for the ping reply: ``"tuned"``, or why not (not
    glibc; the operator set these in the environment, which wins)."""
    if any(k in os.environ for k in _MALLOC_ENV) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "set by the environment"
    try:
        mallopt = LIBC.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8  # <malloc.h>
    ok = all(mallopt(param, value) == 1 for param, value in (
        (m_arena_max, MALLOC_ARENA_MAX), (m_mmap_threshold, MALLOC_MMAP_THRESHOLD),
        (m_trim_threshold, MALLOC_TRIM_THRESHOLD), (m_top_pad, MALLOC_TOP_PAD)))
    return "tuned" if ok else "mallopt refused"


def _settle_heap() -> None:
    """After a mount's tree is built: move what the daemon holds (trees, tables) out of the
    cyclic GC's reach (``gc.freeze``), so that no collection walks tens of thousands of
    long-lived nodes while FUSE requests wait for the GIL."""
    import gc

    gc.freeze()


def _release_heap() -> None:
    """After an unmount (``_NodeDaemon.serve``, once its thread and the work it started are
    done): collect the unmounted tree's cycles now (``gc.unfreeze``, ``collect``, ``freeze``
    again) and give the freed pages back to the system."""
    import gc

    gc.unfreeze()
    gc.collect()   # the tree is cycles: gone now, not at some later collection
    gc.freeze()    # what is still held (other mounts' trees) out of the collector's reach
    # give the freed pages back (``tune_malloc`` keeps them otherwise): a tree is ~1.6 KB
    # a member, hundreds of MB for a big layer
    with contextlib.suppress(OSError, AttributeError):
        LIBC.malloc_trim(0)


class _TreeBudget:
    """The node daemon's part (a mixin of ``_NodeDaemon``) that charges each mount's tree
    against ``tree_budget``, under the daemon's lock."""

    lock: threading.Lock
    mounts: dict[int, str]
    tree_budget: int
    tree_bytes: int

    def _charge_tree(self, digest: str, entries: int) -> int:
        """Reserve the memory of a new mount's tree (``entries`` TOC members) against the
        daemon's ``tree_budget``, before the tree is built: a ``RuntimeShimError`` when it does
        not fit (a hostile layer of 190,000 members cost 300 MB). The mount's end gives it
        back (``_uncharge_tree``)."""
        from envbuild.errors import RuntimeShimError

        charge = entries * TREE_BYTES_PER_ENTRY
        with self.lock:
            if self.tree_bytes + charge <= self.tree_budget:
                self.tree_bytes += charge
                return charge
            used, mounts = self.tree_bytes, len(self.mounts)
        raise RuntimeShimError(
            f"lazy layer {digest}: its tree ({entries} members, ~{charge >> 20} MiB) would take "
            f"the lazy daemon over its memory budget ({used >> 20} of "
            f"{self.tree_budget >> 20} MiB used by {mounts} mounts)",
            hint=f"unmount unused layers (envbuild node gc), raise ${TREE_BUDGET_ENV}, or run "
                 "it without lazy (a full pull)")

    def _uncharge_tree(self, charge: int) -> None:
        with self.lock:
            self.tree_bytes -= charge
