"""The container parts of ``benchmarks/density.py`` (issue 19), each with its baseline measured
in the same run. Imported by ``density.py``; runnable alone with the same arguments.

1. ``bench_fncall``: FnCall calls per second (``python3 -c 'print(input())'`` with a stdin) on
   an ``FnPool`` of 2 (2 client threads), against create → exec → close with the container
   backend (2 threads too). Goal: ratio >= 5.
2. ``bench_cpu_classes``: p50/p99 of ``exec true`` in a latency-class sandbox while one
   best-effort sandbox per core runs a CPU-bound loop, with CPU classes (hogs
   ``cpu_class="best-effort"``) and without (hogs in the latency class, i.e. today).
3. ``bench_reclaim``: N idle container sandboxes that each allocated and freed 200 MB (a
   Python ``bytearray``, written to a file in ``/tmp`` and read back, then freed; the file
   stays): the memory charged to them and the host's free memory, before and after one pass
   of host-side reclaim (``runtime_shim.node.reclaim``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _stats import meminfo, pct  # noqa: E402

from runtime_shim.isolation import cgroupfs  # noqa: E402
from runtime_shim.node import reclaim  # noqa: E402
from runtime_shim.node.model import Limits  # noqa: E402
from runtime_shim.sdk.fnpool import FnPool  # noqa: E402
from runtime_shim.sdk.sandbox import Sandbox  # noqa: E402

MiB = 1 << 20
PY_ECHO = ["python3", "-c", "print(input())"]


def _echo_argv(store, node, env) -> tuple[list[str], str]:
    """python3 if the env has it, else busybox sh (and say so)."""
    with Sandbox.create(env, store=store, node_dir=node) as sb:
        if sb.exec(["python3", "-c", "pass"]).ok:
            return PY_ECHO, "python3 -c 'print(input())'"
    return ["sh", "-c", "read x; echo $x"], "sh -c 'read x; echo $x' (no python3 in the env)"


def _cpu_self() -> float:
    """CPU seconds of this process and its waited-for children (runc, mkfs …)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _cpu_sandbox(sandbox_id: str) -> float:
    found = cgroupfs.controller_dir("cpuacct", sandbox_id)
    return int((found[0] / "cpuacct.usage").read_text()) / 1e9 if found else 0.0


def bench_fncall(store, node, env: str, calls: int, threads: int = 2) -> dict[str, float]:
    argv, what = _echo_argv(store, node, env)
    print(f"fncall: {what}, {calls} calls, {threads} client threads", flush=True)
    sandbox_cpu = [0.0]

    def container_one(i: int) -> None:
        with Sandbox.create(env, store=store, node_dir=node) as sb:
            r = sb.exec(argv, stdin=f"{i}\n".encode())
            assert r.stdout == f"{i}\n".encode(), r
            sandbox_cpu[0] += _cpu_sandbox(sb.id)

    container_one(0)  # warm
    n_base = max(10, calls // 5)
    t, c, sandbox_cpu[0] = time.perf_counter(), _cpu_self(), 0.0
    for i in range(n_base // 2):
        container_one(i)
    base_seq = (n_base // 2) / (time.perf_counter() - t)
    base_cpu = (_cpu_self() - c + sandbox_cpu[0]) / (n_base // 2)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(container_one, range(n_base)))
    base_rate = n_base / (time.perf_counter() - t)

    with Sandbox.create(env, store=store, node_dir=node, backend="fncall") as fn:
        fn.call(argv, stdin="0\n")
        t, c, g = time.perf_counter(), _cpu_self(), _cpu_sandbox(fn.id)
        for i in range(calls // 2):
            r = fn.call(argv, stdin=f"{i}\n")
            assert r.stdout == f"{i}\n".encode(), r
        fn_seq = (calls // 2) / (time.perf_counter() - t)
        fn_cpu = (_cpu_self() - c + _cpu_sandbox(fn.id) - g) / (calls // 2)

    with FnPool(env, size=threads, store=store, node_dir=node) as pool:
        for i in range(4):
            pool.call(argv, stdin=f"{i}\n")
        lat: list[float] = []

        def fn_one(i: int) -> None:
            s = time.perf_counter()
            r = pool.call(argv, stdin=f"{i}\n")
            lat.append(time.perf_counter() - s)
            assert r.stdout == f"{i}\n".encode(), r

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(fn_one, range(calls)))
        fn_rate = calls / (time.perf_counter() - t)
        restarts = sum(sb.handle.restarts for sb in pool.sandboxes)
    ratio, ratio_seq = fn_rate / base_rate, fn_seq / base_seq
    print(f"  one at a time: container create->exec->close {base_seq:7.1f} calls/s, "
          f"one fncall Sandbox {fn_seq:7.1f} calls/s: {ratio_seq:.1f}x")
    print(f"  {threads} threads:     container create->exec->close {base_rate:7.1f} calls/s, "
          f"FnPool(size={threads}) {fn_rate:7.1f} calls/s: {ratio:.1f}x "
          f"(p50 {statistics.median(lat) * 1e3:.1f} ms, p99 {pct(lat, 99) * 1e3:.1f} ms, "
          f"{restarts} container restarts)")
    print(f"  CPU per call (this process + its children + the sandbox's cgroup; load-"
          f"independent): container {base_cpu * 1e3:.1f} ms, fncall {fn_cpu * 1e3:.1f} ms: "
          f"{base_cpu / fn_cpu:.1f}x")
    print(f"  goal >= 5x: {'met' if min(ratio, ratio_seq) >= 5 else 'NOT met'}", flush=True)
    return {"cpu_ratio": base_cpu / fn_cpu, "container_rate": base_rate, "fncall_rate": fn_rate,
            "ratio": ratio,
            "container_seq": base_seq, "fncall_seq": fn_seq, "ratio_seq": ratio_seq}


def _latency_under_load(store, node, env: str, hog_class: str | None, execs: int
                        ) -> list[float]:
    hogs = []
    try:
        for _ in range(os.cpu_count() or 1 if hog_class else 0):
            hog = Sandbox.create(env, store=store, node_dir=node,
                                 limits=Limits(cpu_class=hog_class, cpus=None))
            hogs.append(hog)
            hog.exec("setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &")
        with Sandbox.create(env, store=store, node_dir=node) as sb:
            for _ in range(5):
                sb.exec(["true"])
            times = []
            for _ in range(execs):
                t = time.perf_counter()
                r = sb.exec(["true"])
                times.append(time.perf_counter() - t)
                assert r.ok, r
            return times
    finally:
        for hog in hogs:
            hog.close()


def bench_cpu_classes(store, node, env: str, execs: int) -> dict[str, float]:
    print(f"cpu classes: exec true x{execs} in a latency sandbox, {os.cpu_count()} CPU-bound "
          "hog sandboxes", flush=True)
    out = {}
    for label, hog_class in (("no hogs (the host's own load only)", None),
                             ("without classes (hogs latency)", "latency"),
                             ("with classes (hogs best-effort)", "best-effort")):
        times = _latency_under_load(store, node, env, hog_class, execs)
        out[hog_class or "none"] = pct(times, 99)
        print(f"  {label:34s} p50 {statistics.median(times) * 1e3:7.2f} ms   "
              f"p99 {pct(times, 99) * 1e3:7.2f} ms", flush=True)
    ratio = out["latency"] / out["best-effort"]
    print(f"  p99 without / with: {ratio:.1f}x", flush=True)
    return {"p99_idle": out["none"], "p99_without": out["latency"],
            "p99_with": out["best-effort"], "ratio": ratio}


ALLOC_FREE = ("import os; b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096]); "
              "open('/tmp/blob', 'wb').write(b); open('/tmp/blob', 'rb').read(); del b; "
              "print('ok')")


def bench_reclaim(store, node, env: str, count: int, mb: int) -> dict[str, float]:
    print(f"reclaim: {count} idle container sandboxes, each allocated and freed {mb} MB",
          flush=True)
    argv, _ = _echo_argv(store, node, env)
    use_python = argv == PY_ECHO
    sandboxes: list[Sandbox] = []
    fresh = 0  # what each held right after its workload
    try:
        before = meminfo()
        for _ in range(count):
            sb = Sandbox.create(env, store=store, node_dir=node)
            sandboxes.append(sb)
            if use_python:
                r = sb.exec(["python3", "-c", ALLOC_FREE.format(mb=mb)])
            else:
                r = sb.exec(f"dd if=/dev/zero of=/tmp/blob bs=1M count={mb} 2>/dev/null && "
                            "cat /tmp/blob >/dev/null && echo ok")
            assert r.ok and b"ok" in r.stdout, r
            m = sb.info().memory
            fresh += m.usage if m else 0
        time.sleep(1)
        held = [sb.info().memory for sb in sandboxes]
        charged = sum(m.usage for m in held if m)
        rss = sum(m.rss for m in held if m)
        idle = meminfo()
        t = time.perf_counter()
        results = [reclaim.reclaim(sb.paths) for sb in sandboxes]
        took = time.perf_counter() - t
        after = meminfo()
        charged_after = sum(m.usage for m in (sb.info().memory for sb in sandboxes) if m)
    finally:
        for sb in sandboxes:
            sb.close()
    freed = sum(r.freed for r in results)
    used_idle = before["MemFree"] - idle["MemFree"]
    used_after = before["MemFree"] - after["MemFree"]
    print(f"  charged right after each one's workload: {fresh / MiB:.0f} MB in all (what the "
          "kernel's own LRU took back meanwhile is the difference to the next line)")
    print(f"  charged to the sandboxes: {charged / MiB:8.0f} MB before reclaim "
          f"(anon {rss / MiB:.0f} MB), {charged_after / MiB:8.0f} MB after")
    print(f"  host MemFree drop since start: {used_idle / MiB:8.0f} MB before, "
          f"{used_after / MiB:8.0f} MB after reclaim ({took:.1f} s for {count}; MemFree moves "
          "with everything else on the host too)")
    print(f"  reclaimed: {freed / MiB:.0f} MB ({freed / max(1, charged):.0%} of what they held)",
          flush=True)
    return {"charged_fresh": fresh, "charged_before": charged, "charged_after": charged_after, "freed": freed,
            "host_used_before": used_idle, "host_used_after": used_after}


def run(args, store, node) -> dict[str, dict[str, float]]:
    """The container benchmarks ``density.py`` selected (``args.only``)."""
    out = {}
    if args.only in (None, "fncall"):
        out["fncall"] = bench_fncall(store, node, args.env, args.calls)
    if args.only in (None, "cpu"):
        out["cpu"] = bench_cpu_classes(store, node, args.env, args.execs)
    if args.only in (None, "reclaim"):
        out["reclaim"] = bench_reclaim(store, node, args.env, args.sandboxes, args.mb)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))
    import density

    density.main()
