#!/usr/bin/env python3
"""A node daemon that scales with its cores (issue 39, item 4): creates/s of one node daemon
starting real runc sandboxes through 2 create worker processes against 1, and the daemon's
own CPU per create, on a real local Ray cluster (busybox env).

    PYTHONPATH=. .venv/bin/python benchmarks/fleet_workers.py [--n 100] [--rounds 2]

Three Ray worker nodes on this host, each with its own daemon: ``workers=0`` (today: starts in
the daemon's threads, ``max_starting=2``), ``workers=1`` and ``workers=2`` (``max_starting``
= workers). Each round bursts ``--n`` sandboxes through each daemon in turn (``Fleet.create``
with one node; the order reversed every other round, since the host's load drifts), timed to
the last one ready, then closes them. Per burst: creates/s; the daemon process's CPU per
create (user + system, its own threads only: Ray's call, admission, the attach, the fleet
record); the workers' CPU per create (with runc and the other programs they ran and waited
for). Prints the ratio 2 workers / 1 (goal ≥ 1.6) and the daemon's CPU per create (goal
≤ 5 ms), then what a node of ``--cores`` (190) would sustain from these figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_shim.node.model import Limits  # noqa: E402
from tests import ray_cluster  # noqa: E402,F401  (sets Ray's loopback env before ray loads)

ENV = "env/busybox-shell"
LIMITS = Limits(disk_bytes=None, memory_bytes=64 << 20, pids=16, nofile=256)
CONFIGS = (0, 1, 2)  # create workers per daemon


def cpu_seconds(pid: int, children: bool) -> float:
    """CPU-seconds of ``pid`` (with ``children``: also of its waited-for children)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    used = int(fields[11]) + int(fields[12])
    if children:
        used += int(fields[13]) + int(fields[14])
    return used / tick


def burst(fleet, n: int, daemon_pid: int, worker_pids: list[int]) -> dict[str, float]:
    d0 = cpu_seconds(daemon_pid, children=False)
    w0 = sum(cpu_seconds(p, children=True) for p in worker_pids)
    t0 = time.monotonic()
    sbs = fleet.create(ENV, n=n, limits=LIMITS)
    wall = time.monotonic() - t0
    daemon = cpu_seconds(daemon_pid, children=False) - d0
    workers = sum(cpu_seconds(p, children=True) for p in worker_pids) - w0
    assert len(sbs) == n
    fleet.close_all()
    return {"rate": n / wall, "daemon_ms": daemon / n * 1000, "workers_ms": workers / n * 1000}


def start(cluster, store_dir: str, nodes_dir: Path) -> dict[int, tuple]:
    """One daemon per config on its own Ray node: ``{workers: (fleet, daemon pid, worker
    pids)}``."""
    from runtime_shim.fleet import Fleet
    from runtime_shim.fleet.cluster import fleet_nodes, start_daemons
    from runtime_shim.fleet.model import DaemonConfig
    from runtime_shim.sdk.sandbox import open_store

    node_ids = sorted(n["NodeID"] for n in fleet_nodes())
    out = {}
    for w, node_id in zip(CONFIGS, node_ids, strict=False):
        config = DaemonConfig(store=store_dir, node_dir=str(nodes_dir / "{node_id}"),
                              slots=2048, max_starting=max(2, w), workers=w)
        handles = start_daemons(config, node_ids=[node_id])
        fleet = Fleet(store_dir, open_store(store_dir), handles, owns_ray=False, config=config)
        hello = fleet.call(node_id, "hello")
        fleet.create(ENV, n=2, limits=LIMITS)  # the node cache holds the env, workers warm
        fleet.close_all()
        out[w] = (fleet, hello["pid"], hello["workers"])
    return out


def report(runs: dict[int, list[dict[str, float]]], cores: int) -> None:
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    ratios = [b["rate"] / a["rate"] for a, b in zip(runs[1], runs[2], strict=True)]
    print(f"creates/s, 2 workers / 1: {', '.join(f'{r:.2f}' for r in ratios)} (median "
          f"{statistics.median(ratios):.2f}; goal >= 1.6)")
    for w, m in med.items():
        print(f"workers={w}: {m['rate']:.1f} creates/s, daemon CPU {m['daemon_ms']:.2f} ms per "
              f"create (goal <= 5), workers (with runc) {m['workers_ms']:.1f} ms")
    m = med[2]
    daemon_cap = 1000 / max(m["daemon_ms"], 1e-3)
    node_cap = cores * 1000 / max(m["workers_ms"] + m["daemon_ms"], 1e-3)
    print(f"a {cores}-core node, from these: the daemon's one GIL caps it at ~{daemon_cap:.0f} "
          f"creates/s (1 s / its CPU per create); the cores, at ~{node_cap:.0f}/s "
          f"({cores} x 1 s / the CPU of a create); it sustains the lower, "
          f"~{min(daemon_cap, node_cap):.0f}/s, bound by "
          f"{'the daemon' if daemon_cap < node_cap else 'its cores'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100, help="sandboxes per burst")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cores", type=int, default=190, help="the node to project to")
    args = ap.parse_args()

    import ray

    from tests.integration.conftest import build_busybox_env
    from tests.ray_cluster import start_cluster

    tmp = Path(tempfile.mkdtemp(prefix="fleet-workers-", dir="/tmp"))
    store, _ = build_busybox_env(tmp / "env")
    cluster = start_cluster(workers=len(CONFIGS))
    daemons: dict[int, tuple] = {}
    try:
        ray.init(address=cluster.address, namespace="envbuild", log_to_driver=False)
        daemons = start(cluster, str(store.root), tmp / "nodes")
        runs: dict[int, list[dict[str, float]]] = {w: [] for w in CONFIGS}
        for r in range(args.rounds):
            for w in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
                fleet, pid, workers = daemons[w]
                got = burst(fleet, args.n, pid, workers)
                runs[w].append(got)
                print(f"round {r + 1}, workers={w}: {got['rate']:.1f} creates/s, daemon "
                      f"{got['daemon_ms']:.2f} ms/create, workers {got['workers_ms']:.1f} "
                      f"ms/create; load {os.getloadavg()[0]:.1f}", flush=True)
        report(runs, args.cores)
    finally:
        for fleet, _, _ in daemons.values():
            fleet.stop_daemons()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
