#!/usr/bin/env python3
"""The sandbox fleet on a real local 2-node Ray cluster against the local SDK, same machine,
same run (busybox env; real runc sandboxes).

    PYTHONPATH=. .venv/bin/python benchmarks/fleet_burst.py [--n 200] [--n 1000] [--execs 200]
        [--env env/py-textstats --store DIR --only burst]

1. burst: ``--n`` sandboxes created with one ``Fleet.create`` call over 2 nodes, ``true``
   exec'd in each, closed; sandboxes/s and p50/p99 time to ready, against the same count made
   with ``Sandbox.create`` in one process (as many threads as the fleet starts at once:
   2 nodes × ``--max-starting``). Ratio fleet/local throughput (goal ≥ 0.8).
2. exec round trip of ``true`` through the fleet client vs ``Sandbox.exec`` (goal p50 ≤ 2 ms),
   and the floor: a no-op call to a Ray actor on the same node made like the daemon
   (``num_cpus=0``, the daemon's ``max_concurrency``).
3. warm pool: claim-to-first-exec p50 of one sandbox when the node has a ready one (goal
   ≤ 5 ms): ``create(first_exec="true")`` (one Ray call), and ``create`` then ``exec`` (two),
   vs a cold create + first exec.
4. locality: 100 sandboxes of 4 locks (busybox + a 4 MiB snapshot layer each) in one plan on
   cold nodes, placement by locality vs random: layer bytes the nodes pulled from the store
   (goal: locality ≤ 0.6× random).
5. for the paper estimate: the placement planner's time for 32,000 sandboxes on 160 nodes.

Bursts run in two rounds, fleet-then-local and local-then-fleet, so load that drifts during
the run weighs on both; the median ratio is the figure.

Builds ``env/busybox-shell`` into a temporary store first (the test suite's defs); with
``--store DIR --env REF`` uses that store's env instead (e.g. ``env/py-textstats``, built with
``ENVBUILD_STORE=DIR envbuild build py-textstats``); ``--only burst`` runs part 1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _stats import pct  # noqa: E402

from runtime_shim.node.model import Limits  # noqa: E402
from tests import ray_cluster  # noqa: E402,F401  (sets Ray's loopback env before ray loads)

ENV = "env/busybox-shell"  # --env
LIMITS = Limits(disk_bytes=None, memory_bytes=64 << 20)


def local_burst(store: str, node_dir: str, n: int, threads: int) -> dict[str, float]:
    from runtime_shim.sdk.sandbox import Sandbox

    t0 = time.time()
    with ThreadPoolExecutor(threads) as pool:
        sbs = list(pool.map(lambda _: Sandbox.create(ENV, store=store, node_dir=node_dir,
                                                     limits=LIMITS, reap=False), range(n)))
    wall = time.time() - t0
    ready = [sb.info().ready - t0 for sb in sbs]
    with ThreadPoolExecutor(threads) as pool:
        assert all(pool.map(lambda sb: sb.exec("true").ok, sbs))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda sb: sb.close(), sbs))
    return {"rate": n / wall, "p50": pct(ready, 50), "p99": pct(ready, 99), "wall": wall}


def fleet_burst(fleet, n: int) -> dict[str, float]:
    t0 = time.time()
    sbs = fleet.create(ENV, n=n, limits=LIMITS)
    wall = time.time() - t0
    ready = [sb.record.ready - t0 for sb in sbs]
    nodes = len({sb.node_id for sb in sbs})
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda sb: sb.exec("true").ok, sbs))
    fleet.close_all()
    return {"rate": n / wall, "p50": pct(ready, 50), "p99": pct(ready, 99), "wall": wall,
            "nodes": nodes}


def exec_rtt(fn, count: int) -> float:
    times = []
    for _ in range(count):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _noop_actor(node_id: str):
    """A Ray actor doing nothing, placed and made like the node daemon: the floor of a call."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from runtime_shim.fleet.client import DAEMON_CONCURRENCY

    class Noop:
        def f(self) -> None:
            return None

    return ray.remote(Noop).options(
        num_cpus=0, max_concurrency=DAEMON_CONCURRENCY,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


def make_locks(store: str, node_dir: str) -> list[str]:
    """4 locks: the busybox env plus one 4 MiB random snapshot layer each."""
    from runtime_shim.sdk.sandbox import Sandbox

    locks = []
    for i in range(4):
        with Sandbox.create(ENV, store=store, node_dir=node_dir, limits=LIMITS) as sb:
            sb.write_file(f"/data-{i}", os.urandom(4 << 20))
            locks.append(sb.pack_diff(f"bench/locality-{i}").lock)
    return locks


def main() -> None:
    global ENV
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, action="append", help="burst sizes (default 200)")
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--max-starting", type=int, default=4)
    ap.add_argument("--env", default=ENV)
    ap.add_argument("--store", help="a store holding --env (default: build busybox-shell)")
    ap.add_argument("--only", choices=["burst"])
    args = ap.parse_args()
    sizes = args.n or [200]
    ENV = args.env

    import ray

    from runtime_shim.fleet import Fleet
    from runtime_shim.fleet.placement import NodeLoad, plan
    from tests.integration.conftest import build_busybox_env
    from tests.ray_cluster import start_cluster

    tmp = Path(tempfile.mkdtemp(prefix="h14-fleet-bench-", dir="/tmp"))
    if args.store:
        store_dir = os.path.abspath(args.store)
    else:
        store, _ = build_busybox_env(tmp / "env")
        store_dir = str(store.root)
    print(f"env {ENV}; host load: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores",
          flush=True)
    cluster = start_cluster()
    try:
        ray.init(address=cluster.address, namespace="envbuild", log_to_driver=False)
        fleet = Fleet.connect(address=cluster.address, store=store_dir,
                              node_dir=str(tmp / "nodes" / "{node_id}"), slots=2048,
                              max_starting=args.max_starting)
        threads = args.max_starting * len(fleet.node_ids)
        fleet.close_all()
        fleet.create(ENV, n=4, limits=LIMITS)  # both node caches hold the env, as local's will
        fleet.close_all()
        local_burst(store_dir, str(tmp / "local"), 2, threads)
        for n in sizes:
            ratios = []
            for order in (("fleet", "local"), ("local", "fleet")):  # interleaved: load drifts
                got = {}
                for which in order:
                    got[which] = (fleet_burst(fleet, n) if which == "fleet" else
                                  local_burst(store_dir, str(tmp / "local"), n, threads))
                f, loc = got["fleet"], got["local"]
                ratios.append(f["rate"] / loc["rate"])
                print(f"burst n={n} ({' then '.join(order)}): fleet {f['rate']:.1f}/s over "
                      f"{f['nodes']} nodes (ready p50 {f['p50']:.2f} s, p99 {f['p99']:.2f} s)  "
                      f"local SDK {loc['rate']:.1f}/s ({threads} threads; p50 {loc['p50']:.2f} "
                      f"s, p99 {loc['p99']:.2f} s)  ratio fleet/local {ratios[-1]:.2f}",
                      flush=True)
            print(f"burst n={n}: ratio fleet/local, median of the rounds: "
                  f"{statistics.median(ratios):.2f} (goal >= 0.8); load now "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        if args.only == "burst":
            fleet.stop_daemons()
            return

        from runtime_shim.sdk.sandbox import Sandbox

        sb = fleet.create(ENV, n=1, limits=LIMITS)[0]
        with Sandbox.create(ENV, store=store_dir, node_dir=str(tmp / "local"),
                            limits=LIMITS) as local:
            for _ in range(20):
                sb.exec("true")
                local.exec("true")
            noop = _noop_actor(sb.node_id)
            for _ in range(20):
                ray.get(noop.f.remote())
            f_rtt = exec_rtt(lambda: sb.exec("true"), args.execs)
            l_rtt = exec_rtt(lambda: local.exec("true"), args.execs)
            n_rtt = exec_rtt(lambda: ray.get(noop.f.remote()), args.execs)
            ray.kill(noop)
        print(f"exec round trip p50: fleet {f_rtt:.2f} ms, local SDK {l_rtt:.2f} ms "
              f"(fleet overhead {f_rtt - l_rtt:.2f} ms; goal fleet <= 2 ms); Ray no-op actor "
              f"call {n_rtt:.2f} ms, so the floor of a fleet exec is {n_rtt + l_rtt:.2f} ms",
              flush=True)
        fleet.close_all()

        key = fleet.warm(ENV, per_node=4, limits=LIMITS, wait=120)
        claims, twos, colds = [], [], []
        for i in range(20):
            t = time.perf_counter()
            if i % 2:
                (h,) = fleet.create(ENV, n=1, limits=LIMITS)
                h.exec("true")
                twos.append(time.perf_counter() - t)
            else:
                (h,) = fleet.create(ENV, n=1, limits=LIMITS, first_exec="true")
                claims.append(time.perf_counter() - t)
                assert h.first_result is not None and h.first_result.ok
            h.close()
            fleet.warm(ENV, per_node=4, limits=LIMITS, wait=120)  # refilled before the next
        fleet.warm(ENV, per_node=0, limits=LIMITS)
        for _ in range(5):
            t = time.perf_counter()
            (h,) = fleet.create(ENV, n=1, limits=LIMITS)
            h.exec("true")
            colds.append(time.perf_counter() - t)
            h.close()
        del key
        print(f"warm pool: claim-to-first-exec p50 {statistics.median(claims) * 1000:.1f} ms "
              f"with first_exec (one call), {statistics.median(twos) * 1000:.1f} ms as create "
              f"then exec (two calls), vs cold create+exec {statistics.median(colds) * 1000:.1f} ms "
              f"(ratio {statistics.median(claims) / statistics.median(colds):.3f}; goal "
              f"claim <= 5 ms)", flush=True)
        fleet.stop_daemons()

        locks = make_locks(store_dir, str(tmp / "local"))
        pulled = {}
        for policy in ("locality", "random"):
            cold = Fleet.connect(address=cluster.address, store=store_dir,
                                 node_dir=str(tmp / f"cold-{policy}" / "{node_id}"),
                                 slots=2048, max_starting=args.max_starting)
            cold.create_many([(lock, 25) for lock in locks], placement_policy=policy,
                             limits=LIMITS)
            pulled[policy] = sum(n.pulled_bytes for n in cold.nodes())
            cold.stop_daemons()
        print(f"locality: 100 sandboxes of 4 locks on cold nodes: {pulled['locality'] / 2**20:.1f}"
              f" MiB pulled with locality, {pulled['random'] / 2**20:.1f} MiB random; ratio "
              f"{pulled['locality'] / pulled['random']:.2f} (goal <= 0.6)", flush=True)

        loads = [NodeLoad(f"n{i:03d}", 2400, 0, 1 << 40, 0) for i in range(160)]
        t = time.perf_counter()
        plan(loads, 32_000, {"a": 1, "b": 2, "c": 3})
        print(f"placement of 32,000 sandboxes on 160 nodes: {time.perf_counter() - t:.2f} s "
              f"(pure Python, in the driver)", flush=True)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.cluster.shutdown()
        from runtime_shim.fleet.daemon import reap_node_dir

        for d in list(tmp.glob("nodes/*")) + list(tmp.glob("cold-*/*")) + [tmp / "local"]:
            with contextlib.suppress(Exception):
                reap_node_dir(d)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)  # Ray's session dir (logs, sockets)


if __name__ == "__main__":
    main()
