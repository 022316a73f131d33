#!/usr/bin/env python3
"""The fleet's exec round trip over its data plane against Ray and the local SDK (issue 39,
item 5): p50 of ``--execs`` execs of ``true`` in one busybox sandbox each way, real runc, a real
local Ray cluster with one node whose daemon listens on 127.0.0.1 (``data_host``).

    PYTHONPATH=. .venv/bin/python benchmarks/fleet_exec.py [--execs 300] [--rounds 3]

Each round runs the three one after another, in a rotating order (the host's load drifts):
``local`` (``Sandbox.exec`` in this process), ``direct`` (``FleetSandbox.exec`` over the data
plane) and ``ray`` (the same sandbox's handle without its token: one Ray actor call). Prints
each p50 and ``direct − local`` (goal ≤ 0.5 ms) per round and their medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import pct  # noqa: E402

from runtime_shim.node.model import Limits  # noqa: E402
from tests import ray_cluster  # noqa: E402,F401  (sets Ray's loopback env before ray loads)

ENV = "env/busybox-shell"
LIMITS = Limits(disk_bytes=None, memory_bytes=64 << 20, pids=16, nofile=256)


def p50_ms(fn, count: int) -> float:
    fn()
    times = []
    for _ in range(count):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return pct(times, 50) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import ray

    from runtime_shim.fleet import Fleet, FleetSandbox
    from runtime_shim.sdk.sandbox import Sandbox
    from tests.integration.conftest import build_busybox_env
    from tests.ray_cluster import start_cluster

    tmp = Path(tempfile.mkdtemp(prefix="fleet-exec-", dir="/tmp"))
    store, _ = build_busybox_env(tmp / "env")
    cluster = start_cluster(workers=1)
    fleet = local = None
    try:
        ray.init(address=cluster.address, namespace="envbuild", log_to_driver=False)
        fleet = Fleet.connect(address=cluster.address, store=str(store.root),
                              node_dir=str(tmp / "nodes" / "{node_id}"), data_host="127.0.0.1")
        (sb,) = fleet.create(ENV, n=1, limits=LIMITS)
        via_ray = FleetSandbox(fleet, dataclasses.replace(sb.record, token=None))
        local = Sandbox.create(ENV, store=str(store.root), node_dir=str(tmp / "local"),
                               limits=LIMITS)
        ways = {"local": lambda: local.exec("true"), "direct": lambda: sb.exec("true"),
                "ray": lambda: via_ray.exec("true")}
        got: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(args.rounds):
            names = list(ways)[r % 3:] + list(ways)[:r % 3]
            for name in names:
                got[name].append(p50_ms(ways[name], args.execs))
            print(f"round {r + 1} ({', '.join(names)}): " + ", ".join(
                f"{k} {got[k][-1]:.3f} ms" for k in ways)
                + f"; direct - local {got['direct'][-1] - got['local'][-1]:+.3f} ms; load "
                f"{os.getloadavg()[0]:.1f}", flush=True)
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"exec p50 (median of rounds): local {med['local']:.3f} ms, direct "
              f"{med['direct']:.3f} ms, ray {med['ray']:.3f} ms; direct - local "
              f"{med['direct'] - med['local']:+.3f} ms (goal <= +0.5), ray - local "
              f"{med['ray'] - med['local']:+.3f} ms")
    finally:
        if local is not None:
            local.close()
        if fleet is not None:
            fleet.stop_daemons()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
