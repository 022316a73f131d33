#!/usr/bin/env python3
"""MicroVM restore from a memory snapshot against a cold boot of the same lock (issue 18,
item 2), measured in the same run.

    .venv/bin/python benchmarks/checkpoint_vm.py [--env busybox-shell] [--runs 5]
        [--store cache] [--layers auto|pmem-dax|virtio-blk]

1. Cold boot: ``Sandbox.create(backend="microvm")`` → first ``exec true`` (p50 of ``--runs``).
2. One VM booted, a background loop started in it, checkpointed with ``leave_running=True``:
   seconds, memory-image and disk bytes.
3. Restore: ``Sandbox.create(lock, backend="microvm", restore=image)`` → first ``exec true``
   (p50 of ``--runs``), each restored VM checked to still run the loop; then closed.
4. Fork: ``--fork`` restores of the one image started at once (threads): time until all
   answered exec (what ``sb.fork(n)`` costs built on checkpoint + n restores).

Ratio restore / cold boot; goal <= 0.3 under TCG. Prints the accelerator, the layer
transport and the host load.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._envs import ensure_built  # noqa: E402
from envbuild.store import LocalStore  # noqa: E402
from runtime_shim.backends.vm.checkpoint import VmCheckpoint  # noqa: E402
from runtime_shim.sdk.sandbox import Limits, Sandbox  # noqa: E402

LIMITS = Limits(memory_bytes=256 << 20)


def _restore(image, store, node) -> Sandbox:
    """A VM continuing the unpacked checkpoint ``image``: restore is a field of create."""
    return Sandbox.create(VmCheckpoint.from_record(image.record).lock, store=store,
                          node_dir=node, backend="microvm", restore=image)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="busybox-shell")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--store", type=Path, default=REPO / "cache")
    ap.add_argument("--layers", default="auto")
    ap.add_argument("--fork", type=int, default=4)
    args = ap.parse_args()
    os.environ["ENVBUILD_VM_LAYERS"] = args.layers
    ensure_built(args.store, args.env)
    store = LocalStore(args.store)
    work = Path(tempfile.mkdtemp(prefix="envbuild-ckpt-vm-"))
    node = work / "node"
    print(f"env {args.env}, load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        cold = []
        for _ in range(args.runs):
            t = time.perf_counter()
            with Sandbox.create(args.env, store=store, node_dir=node, backend="microvm",
                                limits=LIMITS) as sb:
                assert sb.exec("true").ok
                cold.append(time.perf_counter() - t)
                accel, transport = sb.handle.request.accel, sb.info().layer_transport
        with Sandbox.create(args.env, store=store, node_dir=node, backend="microvm",
                            limits=LIMITS) as sb:
            sb.exec("i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done "
                    ">/dev/null 2>&1 &")
            time.sleep(0.5)
            t = time.perf_counter()
            image = sb.handle.checkpoint(work / "ck", leave_running=True)
            save = time.perf_counter() - t
        restore, phases = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            with _restore(image, store, node) as rb:
                assert rb.exec("true").ok
                restore.append(time.perf_counter() - t)
                phases.append(rb.handle.timings)
                before = int(rb.exec("cat /tmp/counter").stdout)
                time.sleep(0.3)
                assert int(rb.exec("cat /tmp/counter").stdout) > before, "the loop stopped"
        from concurrent.futures import ThreadPoolExecutor

        def one():
            rb = _restore(image, store, node)
            assert rb.exec("true").ok
            return rb

        t = time.perf_counter()
        with ThreadPoolExecutor(args.fork) as pool:
            children = list(pool.map(lambda _: one(), range(args.fork)))
        fork = time.perf_counter() - t
        for rb in children:
            rb.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c, r = statistics.median(cold), statistics.median(restore)
    print(f"accelerator {accel}, layers {transport}")
    print(f"cold boot → first exec:        p50 {c:6.3f} s  (runs: "
          f"{', '.join(f'{x:.2f}' for x in cold)})")
    print(f"checkpoint (leave_running):        {save:6.3f} s  memory image "
          f"{image.record['files']['memory.img']['size'] / 1e6:.1f} MB, all files "
          f"{image.bytes / 1e6:.1f} MB (disk of {image.record['files']['rw.ext4.sparse']['size'] / 1e9:.1f}"
          f" GB packed)")
    print(f"restore → first exec:          p50 {r:6.3f} s  (runs: "
          f"{', '.join(f'{x:.2f}' for x in restore)})")
    mid = phases[len(phases) // 2]
    print("  restore phases: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in mid.items()))
    print(f"fork({args.fork}) as {args.fork} parallel restores → all answered: {fork:6.3f} s")
    print(f"restore / cold boot: {r / c:.3f}  (goal <= 0.3: {'met' if r / c <= 0.3 else 'NOT met'})")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
