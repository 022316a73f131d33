#!/usr/bin/env python3
"""Sandbox start-up and density, against bare ``runc run`` measured in the same run.

    .venv/bin/python benchmarks/sandbox_start.py [--env py-textstats] [--runs 200] [--disk 10G]

``--disk`` is ``Limits.disk_bytes`` of every sandbox (default: the Limits default; ``0``: no disk
limit, the writable layer straight on the node dir), to measure the start-up cost of the
per-sandbox disk (``runtime_shim.node.diskpool``). ``--disk-modes pool,loop`` measures instead
the disk mechanisms against each other (``ENVBUILD_SANDBOX_DISK``): create → exec → close
interleaved run by run, so the host's load hits each alike, then the loop devices and mounts
``--density`` live sandboxes of each mode hold; and exits.

1. create → exec ``true`` → close, p50 / p95 over ``--runs`` sandboxes (warm node cache), and
   sandboxes per second with 2 workers (``--workers``: forked processes, by default, or
   threads of this process); baseline: ``runc run`` of ``true`` in a pre-made rootfs
   directory (the same env flattened), with the same OCI spec, one at a time and 2 at a time.
   Bare and sandbox runs alternate (one of each, then 2-worker blocks in turn), so the host's
   drift meets both alike. Goal (issue 39): overhead ratio <= 1.3, 2-worker throughput of
   sandboxes >= 0.8 x bare.
2. exec round trip in one live sandbox: p50 / p95 of ``--execs`` ``exec(["true"])`` calls
   (what an agent in RL training pays per command).
3. 100 concurrent idle sandboxes: memory per sandbox (MemAvailable before/after), and whether
   the page cache is shared: each sandbox reads the same large file; the page cache should grow
   by about one copy of it, not 100.

Needs root, runc, and the env built in the store (``envbuild build ENV``; the script builds it if
the store lacks its lock). Cold start from S3 (lazy vs full) is measured by the S3 benchmarks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _envs import ensure_built  # noqa: E402
from _stats import meminfo, pct  # noqa: E402

from envbuild.layers import LayerReader  # noqa: E402
from envbuild.sizes import parse_size  # noqa: E402
from envbuild.store import LocalStore  # noqa: E402
from runtime_shim.isolation.runc import OciRuntime, write_bundle  # noqa: E402
from runtime_shim.isolation.spec import RuntimeSpecRequest, env_list, runtime_spec  # noqa: E402
from runtime_shim.node import diskpool  # noqa: E402
from runtime_shim.node.layout import NodeLayout  # noqa: E402
from runtime_shim.node.locks import resolve  # noqa: E402
from runtime_shim.sdk.sandbox import Limits, Sandbox  # noqa: E402


def flatten(store: LocalStore, env: str, dest: Path) -> None:
    lock = resolve(store, env)
    for layer in lock.layers:
        with LayerReader.open_file(store.blob_path(layer.digest)) as r:
            r.unpack(dest, whiteouts="apply")
    for d in ("proc", "sys", "dev", "tmp", "etc"):
        (dest / d).mkdir(exist_ok=True)
    for f in ("etc/resolv.conf", "etc/hosts"):
        (dest / f).touch()


def runc_baseline(store, env, work: Path) -> Callable[[int], float]:
    """One bare ``runc run`` of ``true`` in the env flattened into a directory, with the same
    OCI spec: the seconds it took."""
    rootfs = work / "rootfs"
    flatten(store, env, rootfs)
    lock = resolve(store, env)
    runtime = OciRuntime(state_root=str(work / "runc"))
    bundle = work / "bundle"
    write_bundle(bundle, runtime_spec(RuntimeSpecRequest(
        rootfs=str(rootfs), args=("true",), env=env_list(lock.env), cwd="/", pids_limit=512,
        memory_limit=2 << 30)))

    def one(i: int) -> float:
        t = time.perf_counter()
        subprocess.run(runtime.command("run", "--bundle", str(bundle), f"eb-bench-{i}"),
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t

    return one


def sandbox_lifecycle(store, env, node: Path) -> Callable[[int], float]:
    """One create → exec ``true`` → close: the seconds it took."""
    def one(_: int) -> float:
        t = time.perf_counter()
        with Sandbox.create(env, store=store, node_dir=node, limits=LIMITS) as sb:
            r = sb.exec(["true"])
            assert r.exit_code == 0, r.stderr
        return time.perf_counter() - t

    return one


def interleaved(bare: Callable[[int], float], ours: Callable[[int], float], runs: int,
                workers: str = "process") -> tuple[list[float], float, list[float], float]:
    """Bare and sandbox runs one after the other (so the host's drift hits both alike), then
    each with 2 workers in alternating quarters: (bare times, bare per s, ours, ours per s).
    ``workers``: ``process`` (two forked processes, as the fleet's node daemon creates) or
    ``thread`` (two threads of this process, sharing its GIL)."""
    ours(0)  # warm the node cache (unpack once)
    base_times, our_times = [], []
    for i in range(runs):
        base_times.append(bare(i))
        our_times.append(ours(i))
    elapsed = {bare: 0.0, ours: 0.0}
    quarter = max(1, runs // 2)
    for block in range(4):
        fn = (bare, ours)[block % 2]
        start = runs + block * quarter
        t = time.perf_counter()
        (in_processes if workers == "process" else in_threads)(fn, range(start, start + quarter))
        elapsed[fn] += time.perf_counter() - t
    return (base_times, 2 * quarter / elapsed[bare], our_times, 2 * quarter / elapsed[ours])


def in_threads(fn: Callable[[int], float], indices: range) -> None:
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(fn, indices))


def in_processes(fn: Callable[[int], float], indices: range) -> None:
    """``fn`` over ``indices`` in two forked processes, every other index each."""
    pids = []
    for w in range(2):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for i in indices[w::2]:
                    fn(i)
            except BaseException as e:  # noqa: BLE001 - reported, then the exit code says it
                print(f"worker: {e!r}", file=sys.stderr)
                code = 1
            os._exit(code)  # no exit hooks: the parent's sandboxes and pool are not ours
        pids.append(pid)
    failed = [pid for pid in pids if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    if failed:
        raise SystemExit(f"{len(failed)} worker(s) failed")


def bench_exec_rtt(store, env, node: Path, count: int) -> list[float]:
    times = []
    with Sandbox.create(env, store=store, node_dir=node, limits=LIMITS) as sb:
        for _ in range(5):  # warm up
            sb.exec(["true"])
        for _ in range(count):
            t = time.perf_counter()
            r = sb.exec(["true"])
            times.append(time.perf_counter() - t)
            assert r.exit_code == 0, r.stderr
    return times


def bench_density(store, env, node: Path, count: int, big_file: str) -> dict[str, float]:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    before = meminfo()
    sandboxes = []
    # idle sandboxes with few processes (the default 256 pids each: the tasks budget, 75% of
    # kernel.pid_max 32768 on this host, holds 96 of them)
    idle_limits = dataclasses.replace(LIMITS, pids=16, nofile=256)
    try:
        with ThreadPoolExecutor(4) as pool:
            sandboxes = list(pool.map(
                lambda _: Sandbox.create(env, store=store, node_dir=node, limits=idle_limits),
                range(count)))
        time.sleep(1)
        idle = meminfo()
        size = int(sandboxes[0].exec(["stat", "-c", "%s", big_file]).stdout)
        for sb in sandboxes:
            assert sb.exec(["cat", big_file], timeout=30).exit_code == 0
        after = meminfo()
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda sb: sb.close(), sandboxes))
    return {
        "mem_per_sandbox": (before["MemAvailable"] - idle["MemAvailable"]) / count,
        "file_size": size,
        "cache_growth": after["Cached"] - idle["Cached"],
    }


def bench_disk_modes(store, env, node: Path, runs: int, modes: list[str], live: int) -> None:
    """Per mode: create, exec and close p50, interleaved run by run, with one pooled sandbox
    alive throughout (a node is rarely empty: the pool's mount when its first sandbox comes is
    ``benchmarks/scratchfs.py``'s); then kernel objects per live sandbox (loop devices and
    mounts under ``node``)."""
    def one(mode: str) -> tuple[float, float, float]:
        os.environ["ENVBUILD_SANDBOX_DISK"] = mode
        t0 = time.perf_counter()
        sb = Sandbox.create(env, store=store, node_dir=node, limits=LIMITS)
        t1 = time.perf_counter()
        assert sb.exec(["true"]).exit_code == 0
        t2 = time.perf_counter()
        sb.close()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for mode in modes:
        one(mode)  # warm: the node cache, the loop template, the pool
    os.environ["ENVBUILD_SANDBOX_DISK"] = "pool"
    anchor = Sandbox.create(env, store=store, node_dir=node, limits=LIMITS)
    times: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    loads = []
    try:
        for _ in range(runs):
            for mode in modes:
                times[mode].append(one(mode))
            loads.append(os.getloadavg()[0])
    finally:
        anchor.close()
    print(f"\nenv {env}, disk {LIMITS.disk_bytes >> 20} MiB, {runs} runs per mode interleaved, "
          f"load {min(loads):.1f}-{max(loads):.1f}")
    for mode in modes:
        phase = [statistics.median(t[i] for t in times[mode]) * 1e3 for i in range(3)]
        total = [sum(t) for t in times[mode]]
        print(f"  {mode:5} p50 create {phase[0]:6.1f}  exec {phase[1]:5.1f}  close {phase[2]:6.1f}"
              f"  total {statistics.median(total) * 1e3:6.1f} ms (p95 {pct(total, 95) * 1e3:6.1f})")
    for mode in modes:
        os.environ["ENVBUILD_SANDBOX_DISK"] = mode
        idle = dataclasses.replace(LIMITS, pids=16, nofile=256)
        sbs = [Sandbox.create(env, store=store, node_dir=node, limits=idle) for _ in range(live)]
        try:
            loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True,
                                   check=True).stdout.count(str(node))
            with open("/proc/self/mountinfo") as f:
                mounts = sum(f" {node}/" in line for line in f)
        finally:
            for sb in sbs:
                sb.close()
        print(f"  {mode:5} {live} live sandboxes: {loops} loop devices, {mounts} mounts "
              f"({loops / live:.2f} and {mounts / live:.2f} per sandbox)")


LIMITS = Limits()


def main() -> int:
    global LIMITS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(REPO / "cache"))
    ap.add_argument("--env", default="py-textstats")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--density", type=int, default=100)
    ap.add_argument("--big-file", default="/usr/bin/python3.11")
    ap.add_argument("--disk", default=None, help="Limits.disk_bytes, e.g. 10G; 0: none")
    ap.add_argument("--disk-modes", default=None,
                    help="compare ENVBUILD_SANDBOX_DISK modes, e.g. pool,loop (then exit)")
    ap.add_argument("--no-hold", action="store_true",
                    help="measure as a script does (the disk pool unmounted with each last "
                         "sandbox), not as a node's server or fleet daemon (pools held a minute)")
    ap.add_argument("--workers", choices=("process", "thread"), default="process",
                    help="what the 2 workers are: forked processes (as the fleet's node "
                         "daemon's) or threads of one process (sharing its GIL)")
    args = ap.parse_args()
    if not args.no_hold:  # as `envbuild serve` and a fleet node daemon (docs/disk-pool.md)
        diskpool.hold_pools()
    if args.disk is not None:
        LIMITS = Limits(disk_bytes=parse_size(args.disk) or None)
    if os.geteuid() != 0:
        print("needs root (mounts, runc)", file=sys.stderr)
        return 1
    store_dir = Path(args.store)
    ensure_built(store_dir, args.env)
    store = LocalStore(store_dir)
    work = Path(tempfile.mkdtemp(prefix="eb-sandbox-bench-"))
    if args.disk_modes:
        try:
            bench_disk_modes(store, args.env, work / "node", args.runs,
                             args.disk_modes.split(","), args.density)
        finally:
            diskpool.unmount_idle(NodeLayout(work / "node"))
            shutil.rmtree(work, ignore_errors=True)
        return 0
    try:
        base_times, base_rate, ours, our_rate = interleaved(
            runc_baseline(store, args.env, work),
            sandbox_lifecycle(store, args.env, work / "node"), args.runs, args.workers)
        rtt = bench_exec_rtt(store, args.env, work / "node", args.execs)
        density = bench_density(store, args.env, work / "node", args.density, args.big_file)
    finally:
        diskpool.unmount_idle(NodeLayout(work / "node"))  # its grace cut short
        shutil.rmtree(work, ignore_errors=True)
    p50, p95 = statistics.median(ours), pct(ours, 95)
    b50, b95 = statistics.median(base_times), pct(base_times, 95)
    disk = "none" if LIMITS.disk_bytes is None else f"{LIMITS.disk_bytes >> 20} MiB"
    print(f"\nenv {args.env}, {args.runs} runs each, warm node cache, runtime runc, "
          f"disk limit {disk}")
    print(f"{'':38} {'p50 ms':>8} {'p95 ms':>8} {'per s (2 workers)':>18}")
    print(f"{'bare runc run (flattened rootfs)':38} {b50 * 1e3:8.1f} {b95 * 1e3:8.1f} {base_rate:18.1f}")
    print(f"{'Sandbox create+exec true+close':38} {p50 * 1e3:8.1f} {p95 * 1e3:8.1f} {our_rate:18.1f}")
    print(f"overhead ratio p50 {p50 / b50:.2f}, p95 {p95 / b95:.2f} (goal <= 1.3); 2-worker "
          f"({args.workers} each) throughput sandboxes / bare {our_rate / base_rate:.2f} "
          f"(goal >= 0.8); "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"exec(['true']) round trip in a live sandbox ({args.execs} execs): "
          f"p50 {statistics.median(rtt) * 1e3:.2f} ms, p95 {pct(rtt, 95) * 1e3:.2f} ms")
    print(f"\n{args.density} idle sandboxes: {density['mem_per_sandbox'] / 1e6:.2f} MB of memory each")
    print(f"each read {density['file_size'] / 1e6:.1f} MB ({args.big_file}); page cache grew by "
          f"{density['cache_growth'] / 1e6:.1f} MB = "
          f"{density['cache_growth'] / max(1, density['file_size']):.2f} copies "
          f"(1.0 = shared, {args.density} = duplicated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
