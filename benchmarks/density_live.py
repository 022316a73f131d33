#!/usr/bin/env python3
"""Create cost against the sandboxes already alive (issue 39, item 1).

    .venv/bin/python benchmarks/density_live.py [--max 3000] [--step 500] [--probe 50]

Idle busybox sandboxes are added ``--step`` at a time up to ``--max``; at each level,
``--probe`` create → exec ``true`` lifecycles are timed (each probe sandbox joins the live
ones), and the host's memory and kernel objects (mounts, loop devices, cgroups, processes)
are counted. At the end every sandbox is closed and the close time per sandbox measured.
Prints, per level: p50 create+exec, p50 of the first level (the baseline), their ratio (goal
at the top level ≤ 1.15), host memory per idle sandbox (MemAvailable drop ÷ sandboxes; goal
≤ 1 MB beyond the sandbox's own processes), and objects per sandbox.

``--disk``: each sandbox's disk limit (default ``none``: no per-sandbox disk, since a disk
per sandbox is a loop device each and the node's disk budget reserves every sandbox's whole
cap: see the issue's item 2). Needs root, runc and the busybox env (built on first use under
``--root``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _stats import meminfo, pct  # noqa: E402

from envbuild.sizes import parse_size  # noqa: E402
from runtime_shim import Limits, Sandbox  # noqa: E402

ENV = "env/busybox-shell"


def kernel_objects(node: Path) -> dict[str, int]:
    """Mounts under the node dir, loop devices in use, envbuild cgroups, processes."""
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for line in f if line.split()[4].startswith(str(node)))
    loops = sum(1 for p in Path("/sys/block").glob("loop*") if (p / "loop" / "backing_file").exists())
    # distinct sandbox cgroups (on a cgroup v1 host each is a dir in every hierarchy: 10 here);
    # read per hierarchy, tolerating dirs that go while listed (other sandboxes of the host)
    ids: set[str] = set()
    for parent in [*Path("/sys/fs/cgroup").glob("envbuild"),
                   *Path("/sys/fs/cgroup").glob("*/envbuild")]:
        try:
            ids.update(e.name for e in os.scandir(parent) if e.name.startswith("eb-"))
        except FileNotFoundError:
            pass
    cgroups = len(ids)
    procs = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
    return {"mounts": mounts, "loops": loops, "cgroups": cgroups, "procs": procs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max", type=int, default=3000)
    parser.add_argument("--step", type=int, default=500)
    parser.add_argument("--probe", type=int, default=50)
    parser.add_argument("--disk", default="none", help="disk limit per sandbox, or none")
    parser.add_argument("--pids", type=int, default=8,
                        help="Limits.pids per sandbox (default 8: 3,000 x 8 fit the node's tasks "
                             "budget, 75%% of kernel.pid_max 32768; raise pid_max for more)")
    parser.add_argument("--root", default=None, help="where the env is built (default: tmp)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-density-"))
    if not (root / "store").exists():
        from tests.integration.conftest import build_busybox_env

        build_busybox_env(root)
    store, node = str(root / "store"), root / "node"
    disk = None if args.disk == "none" else parse_size(args.disk)
    limits = Limits(disk_bytes=disk, memory_bytes=32 << 20, pids=args.pids, nofile=64)
    live: list[Sandbox] = []
    before, objects0 = meminfo()["MemAvailable"], kernel_objects(node)
    base = None
    print(f"{'live':>6} {'p50 ms':>8} {'p95 ms':>8} {'ratio':>6} {'MB/sb':>6} {'load':>5}  "
          "objects per sandbox")
    try:
        while len(live) < args.max:
            target = min(args.max, len(live) + args.step) - args.probe
            while len(live) < target:
                live.append(Sandbox.create(ENV, store=store, node_dir=node, limits=limits))
            times = []
            for _ in range(args.probe):
                t = time.monotonic()
                sb = Sandbox.create(ENV, store=store, node_dir=node, limits=limits)
                sb.exec(["true"])
                times.append(time.monotonic() - t)
                live.append(sb)
            p50 = statistics.median(times)
            base = base or p50
            mem = (before - meminfo()["MemAvailable"]) / len(live) / 1e6
            objs = kernel_objects(node)
            per = ", ".join(f"{k} {(objs[k] - objects0[k]) / len(live):.2f}" for k in objs)
            print(f"{len(live):>6} {p50 * 1e3:8.1f} {pct(times, 95) * 1e3:8.1f} "
                  f"{p50 / base:6.2f} {mem:6.2f} {os.getloadavg()[0]:5.1f}  {per}", flush=True)
    finally:
        started, n = time.monotonic(), len(live)
        for sb in live:
            sb.close()
        if n:
            print(f"close: {(time.monotonic() - started) / n * 1e3:.1f} ms per sandbox at "
                  f"{n} live (goal ≤ 15)")
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
