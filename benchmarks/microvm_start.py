#!/usr/bin/env python3
"""MicroVM start-up, against a bare QEMU boot of the same kernel measured in the same run.

    .venv/bin/python benchmarks/microvm_start.py [--envs busybox-shell py-textstats] [--runs 10]

Per env (layers already unpacked in the node cache, as after any earlier container run):

1. EROFS preparation: every layer of the lock → ``<node>/erofs/<hex>.erofs``, cold (images
   removed first; p50 of 3) and warm (images present: a stat per layer).
2. create → exec ``true`` → close, p50 over ``--runs``, split into host preparation (kernel,
   initramfs, EROFS warm, writable disk + config), boot to agent-ready (QEMU start until the
   agent's HELLO over virtio serial), first exec, close.
3. exec round trip in one live VM: p50 / p95 of ``--execs`` ``exec(["true"])``.

Baseline: ``qemu-system-x86_64 -M microvm`` with the same kernel image, accelerator, memory and
command line, and a minimal initramfs (static busybox, ``init`` = ``poweroff -f``), from spawn to
exit. Goals: (create + exec + close) / bare boot <= 1.3 with warm EROFS images; exec round trip
< 20 ms once booted. Prints whether KVM or TCG ran.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _stats import pct  # noqa: E402

from envbuild.store import LocalStore  # noqa: E402
from runtime_shim.backends.vm import erofs, initramfs, qemu  # noqa: E402
from runtime_shim.backends.vm import kernel as vmkernel  # noqa: E402
from runtime_shim.node.locks import resolve  # noqa: E402
from runtime_shim.node.nodecache import NodeCache  # noqa: E402
from runtime_shim.sdk.sandbox import Limits, Sandbox  # noqa: E402

MEMORY = 512 << 20


def ms(x: float) -> str:
    return f"{x * 1000:8.1f} ms"


def bare_boot(node: Path, runs: int) -> tuple[list[float], str]:
    kern = vmkernel.find_kernel(os.environ)
    image = vmkernel.boot_image(node, kern)
    entries = initramfs.initramfs_entries(
        busybox=initramfs.host_busybox().read_bytes(), modules=[], agent=None,
        init_script="#!/bin/busybox sh\n/bin/busybox poweroff -f\n")
    initrd = node / "bare-initramfs.cpio"
    initrd.write_bytes(initramfs.newc_archive(entries))
    accel = qemu.choose_accel(node, str(image), str(initrd))
    req = qemu.VmRequest(kernel=str(image), initrd=str(initrd),
                         cmdline=vmkernel.kernel_cmdline(tsc_khz=vmkernel.host_tsc_khz()),
                         drives=(), agent_socket=None, memory_mib=MEMORY >> 20, accel=accel,
                         qemu=qemu.find_qemu())
    argv = qemu.qemu_argv(req)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=120)
        times.append(time.perf_counter() - t)
    return times, accel


def erofs_prep(store: LocalStore, node: NodeCache, env: str, cold_runs: int = 3):
    lock = resolve(store, env)
    dirs = [node.ensure(store, layer.digest, layer.toc_digest) for layer in lock.layers]
    cold, warm = [], []
    for _ in range(cold_runs):
        for layer in lock.layers:
            erofs.erofs_path(node.root, layer.digest).unlink(missing_ok=True)
        t = time.perf_counter()
        for layer, d in zip(lock.layers, dirs):
            erofs.ensure_erofs(node.root, layer.digest, d)
        cold.append(time.perf_counter() - t)
    for _ in range(20):
        t = time.perf_counter()
        for layer, d in zip(lock.layers, dirs):
            erofs.ensure_erofs(node.root, layer.digest, d)
        warm.append(time.perf_counter() - t)
    size = sum(erofs.erofs_path(node.root, layer.digest).stat().st_size for layer in lock.layers)
    return cold, warm, len(lock.layers), size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=str(REPO / "cache"))
    ap.add_argument("--envs", nargs="+", default=["busybox-shell", "py-textstats"])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--execs", type=int, default=200)
    args = ap.parse_args()
    store = LocalStore(args.store)
    tmp = Path(tempfile.mkdtemp(prefix="microvm-bench-"))
    try:
        node = NodeCache(tmp / "node")
        bare, accel = bare_boot(node.root, args.runs)
        print(f"accelerator: {accel.upper()}   (memory {MEMORY >> 20} MiB, 1 vCPU, "
              f"{os.cpu_count()} host cores)")
        print(f"bare QEMU microvm boot → poweroff, p50 of {args.runs}: {ms(statistics.median(bare))}")
        for env in args.envs:
            cold, warm, nlayers, size = erofs_prep(store, node, env)
            print(f"\n== {env}: {nlayers} layers, EROFS images {size / 1e6:.1f} MB")
            print(f"  EROFS prep cold (p50 of {len(cold)})   {ms(statistics.median(cold))}")
            print(f"  EROFS prep warm (p50 of {len(warm)})  {ms(statistics.median(warm))}")
            phases: dict[str, list[float]] = {k: [] for k in
                                               ("host_prep", "boot", "first_exec", "close",
                                                "total")}
            for _ in range(args.runs):
                t0 = time.perf_counter()
                sb = Sandbox.create(env, store=store, node_dir=tmp, backend="microvm",
                                    limits=Limits(memory_bytes=MEMORY))
                t1 = time.perf_counter()
                assert sb.exec(["true"]).ok
                t2 = time.perf_counter()
                sb.close()
                t3 = time.perf_counter()
                tm = sb.handle.timings
                phases["boot"].append(tm["boot"])
                phases["host_prep"].append((t1 - t0) - tm["boot"])
                phases["first_exec"].append(t2 - t1)
                phases["close"].append(t3 - t2)
                phases["total"].append(t3 - t0)
            for k, v in phases.items():
                print(f"  {k:<12} p50 {ms(statistics.median(v))}   p95 {ms(pct(v, 95))}")
            ratio = statistics.median(phases["total"]) / statistics.median(bare)
            print(f"  overhead ratio (create+exec+close / bare boot): {ratio:.2f}  (goal <= 1.3)")
            with Sandbox.create(env, store=store, node_dir=tmp, backend="microvm",
                                limits=Limits(memory_bytes=MEMORY)) as sb:
                rtts = []
                for _ in range(args.execs):
                    t = time.perf_counter()
                    sb.exec(["true"])
                    rtts.append(time.perf_counter() - t)
            print(f"  exec round trip, {args.execs} × true: p50 {ms(statistics.median(rtts))}  "
                  f"p95 {ms(pct(rtts, 95))}  (goal < 20 ms)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
