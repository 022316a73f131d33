#!/usr/bin/env python3
"""Container checkpoints with memory (CRIU) against starting over, measured in the same run.

    .venv/bin/python benchmarks/checkpoint.py [--store cache] [--heaps 50,500] [--fork 8]

For each heap size H (MB): a sandbox of py-textstats runs a Python process that builds an H MB
heap (its "set-up": ``SETUP``, a list of distinct strings, so the work is real), then:

- **checkpoint**: ``sb.checkpoint(leave_running=True)`` — seconds, memory-image bytes (the dump)
  and stored bytes (the packed image blob), files bytes (the snapshot layer);
- **restore + first exec** on a second node dir: ``Sandbox.restore`` then one ``exec``;
- **baseline: fresh create + set-up**: ``Sandbox.create`` of the same lock, then re-running the
  set-up until the process is ready again (the same ready marker), then one ``exec``.

Then ``sb.fork(N)``: time to N ready children (checkpoint + N restores). Ratios are
restore / baseline, in this run. Needs root, runc, a CRIU >= 4.2 (``scripts/build-criu.sh``) and
py-textstats in the store (built first if missing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _envs import ensure_built  # noqa: E402

from runtime_shim import Limits, Sandbox  # noqa: E402

SETUP = r"""
import os, time
heap = [str(i).rjust(92, "x") for i in range({n})]   # ~{mb} MB of distinct strings
open("/workspace/ready.tmp", "w").write(str(len(heap)))
os.replace("/workspace/ready.tmp", "/workspace/ready")
while True:
    time.sleep(1)
"""


def start_setup(sb: Sandbox, mb: int) -> None:
    n = mb * 1024 * 1024 // 141  # a 92-char str object is ~141 bytes with its list slot
    sb.write_file("/workspace/setup.py", SETUP.format(n=n, mb=mb))
    sb.exec("rm -f /workspace/ready; cd /workspace && (python3 setup.py > /dev/null 2>&1 &)")


def wait_ready(sb: Sandbox, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sb.exec("test -f /workspace/ready").exit_code == 0:
            return
        time.sleep(0.05)
    raise SystemExit("the set-up did not finish")


def one_size(store: str, node: Path, mb: int) -> None:
    limits = Limits(memory_bytes=max(2 << 30, (mb * 4) << 20))
    with Sandbox.create("env/py-textstats", store=store, node_dir=node / "a",
                        limits=limits, checkpointable=True) as sb:
        start_setup(sb, mb)
        wait_ready(sb)
        made = sb.checkpoint(f"ckpt/bench-{mb}", leave_running=True)
    with Sandbox.create("env/py-textstats", store=store, node_dir=node / "b"):
        pass  # node b has the lock's layers unpacked before either is timed
    t = time.monotonic()
    back = Sandbox.restore(f"ckpt/bench-{mb}", store=store, node_dir=node / "b", limits=limits)
    back.exec("true")
    restore_s = time.monotonic() - t
    back.close()
    t = time.monotonic()
    with Sandbox.create("env/py-textstats", store=store, node_dir=node / "b",
                        limits=limits) as fresh:
        start_setup(fresh, mb)
        wait_ready(fresh)
        fresh.exec("true")
    baseline_s = time.monotonic() - t
    print(f"heap {mb:4d} MB: checkpoint {made.seconds:6.2f} s (dump {made.dump_seconds:5.2f} s), "
          f"image {made.image_bytes / 1e6:7.1f} MB, stored {made.image_stored / 1e6:7.1f} MB, "
          f"files {made.files_bytes / 1e3:6.1f} kB")
    print(f"           restore + first exec {restore_s:6.2f} s vs fresh create + set-up "
          f"{baseline_s:6.2f} s: {restore_s / baseline_s:5.2f}x")


def fork_bench(store: str, node: Path, n: int) -> None:
    with Sandbox.create("env/py-textstats", store=store, node_dir=node / "a",
                        checkpointable=True) as sb:
        start_setup(sb, 50)
        wait_ready(sb)
        t = time.monotonic()
        kids = sb.fork(n)
        for k in kids:
            k.exec("true")
        took = time.monotonic() - t
        for k in kids:
            k.close()
    t = time.monotonic()
    for _ in range(n):
        with Sandbox.create("env/py-textstats", store=store, node_dir=node / "a") as fresh:
            start_setup(fresh, 50)
            wait_ready(fresh)
    baseline = time.monotonic() - t
    print(f"fork({n}) of a 50 MB-heap sandbox: {took:6.2f} s to {n} ready children "
          f"({took / n:5.2f} s each) vs {n} fresh create + set-up {baseline:6.2f} s: "
          f"{took / baseline:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=str(REPO / "cache"))
    ap.add_argument("--heaps", default="50,500", help="heap sizes in MB, comma-separated")
    ap.add_argument("--fork", type=int, default=8)
    args = ap.parse_args()
    ensure_built(Path(args.store), "py-textstats")
    with tempfile.TemporaryDirectory(prefix="envbuild-ckpt-bench-") as tmp:
        for mb in (int(x) for x in args.heaps.split(",") if x):
            one_size(args.store, Path(tmp), mb)
        if args.fork:
            fork_bench(args.store, Path(tmp), args.fork)


if __name__ == "__main__":
    main()
