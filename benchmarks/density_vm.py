#!/usr/bin/env python3
"""MicroVM page-cache sharing (issue 19, item 1): host memory growth when N microVMs read the
same files, with the layers on virtio-pmem + DAX against virtio-blk, measured in the same run.

    .venv/bin/python benchmarks/density_vm.py [--vms 8] [--mb 100] [--work /tmp/h-vm-density]

The env is busybox-tiny plus a workspace of ``--mb`` MB of incompressible files at /data
(built once into ``--work``; the copies ratio depends on the bytes read, not on the env). For
each transport (``ENVBUILD_VM_LAYERS``): evict the host's page cache of the node's EROFS
images, boot ``--vms`` VMs (256 MiB each, no balloon so nothing is handed back mid-run),
measure, have every VM ``cat /data/*``, measure again.

Host memory attributable to the VMs = the sum of every QEMU's anonymous RSS (guest RAM it
touched: the guest's own page cache lives there) + the host page cache holding the EROFS
images (``fincore``: shared pages counted once, however many VMs map them). Growth / data size
is the number of copies of the data on the host: ``virtio-blk`` ≈ VMs + 1 (each guest caches
its own copy, the host one more), ``pmem-dax`` ≈ 1 (the guests read the host's page cache
directly). Goal: pmem-dax ≤ 1.5 copies. ``MemAvailable``'s drop is printed as a cross-check
(system-wide: noisy while others run).

Memory given back (issue 19, item 2; ``--balloon-vms``, default 4): idle VMs of 512 MiB each
allocate 200 MB in the guest (a tmpfs file) and free it; the sum of their QEMUs' anonymous
RSS after boot, at the peak and 20 s after the free, with the virtio-balloon's free page
reporting off and on (``ENVBUILD_VM_BALLOON``), in the same run. ``--only`` runs one half.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envbuild.store import LocalStore  # noqa: E402
from runtime_shim.sdk.sandbox import Limits, Sandbox  # noqa: E402
from tests.data_env import build_data_env  # noqa: E402

FILE_MB = 2


def build(work: Path, mb: int) -> LocalStore:
    """The density env in ``work/store`` (built once)."""
    marker = work / f"built-{mb}"
    if marker.exists():
        return LocalStore(work / "store")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"building the density env ({mb} MB of data) into {work / 'store'} …", flush=True)
    store, _, _ = build_data_env(work, "density", mb // FILE_MB, FILE_MB << 20, seed=0,
                                 timeout=3600)
    marker.touch()
    return store


def anon_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    return 0


def cached(paths: list[Path]) -> int:
    if not paths:
        return 0
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                          *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return 0


def measure(store: LocalStore, node: Path, transport: str, vms: int, data_bytes: int) -> dict:
    os.environ["ENVBUILD_VM_LAYERS"] = transport
    os.environ["ENVBUILD_VM_BALLOON"] = "0"
    images = sorted((node / "node" / "erofs").glob("*.erofs"))
    evict(images)
    boxes: list[Sandbox] = []
    try:
        t0 = time.monotonic()
        for _ in range(vms):
            boxes.append(Sandbox.create("density", store=store, node_dir=node,
                                        backend="microvm", limits=Limits(memory_bytes=256 << 20)))
        boot = time.monotonic() - t0
        assert all(sb.info().layer_transport == transport for sb in boxes)
        images = sorted((node / "node" / "erofs").glob("*.erofs"))
        pids = [sb.host_pid for sb in boxes]
        before = sum(anon_rss(p) for p in pids) + cached(images)
        avail_before = mem_available()
        t0 = time.monotonic()
        for sb in boxes:
            r = sb.exec("cat /data/* | wc -c", timeout=600)
            assert r.ok and int(r.stdout) == data_bytes, (r.stdout, r.stderr)
        read = time.monotonic() - t0
        anon = sum(anon_rss(p) for p in pids)
        host_cache = cached(images)
        after = anon + host_cache
        avail_drop = avail_before - mem_available()
    finally:
        for sb in boxes:
            sb.close()
    growth = after - before
    return {"transport": transport, "boot_s": boot / vms, "read_s": read / vms,
            "growth": growth, "copies": growth / data_bytes, "anon_after": anon,
            "host_cache_after": host_cache, "avail_drop_copies": avail_drop / data_bytes}


def settle_rss(pids: list[int], wait: float = 20.0) -> int:
    """The VMs' summed anonymous RSS after ``wait`` seconds, the same wait with reporting on
    and off (the guest reports freed pages ~2 s after freeing them, later on a busy host)."""
    time.sleep(wait)
    return sum(anon_rss(p) for p in pids)


def balloon(store: LocalStore, node: Path, vms: int, reporting: bool) -> dict:
    os.environ["ENVBUILD_VM_LAYERS"] = "auto"
    os.environ["ENVBUILD_VM_BALLOON"] = "1" if reporting else "0"
    boxes: list[Sandbox] = []
    try:
        for _ in range(vms):
            boxes.append(Sandbox.create("density", store=store, node_dir=node,
                                        backend="microvm", limits=Limits(memory_bytes=512 << 20)))
        pids = [sb.host_pid for sb in boxes]
        before = settle_rss(pids)
        for sb in boxes:
            r = sb.exec("head -c 200m /dev/zero > /dev/shm/fill", timeout=300)
            assert r.ok, r.stderr
        peak = sum(anon_rss(p) for p in pids)
        for sb in boxes:
            assert sb.exec("rm /dev/shm/fill").ok
        after = settle_rss(pids)
        reclaimed = sum(sb.handle.memory().reclaimed for sb in boxes)
    finally:
        for sb in boxes:
            sb.close()
    return {"reporting": reporting, "before": before, "peak": peak, "after": after,
            "reclaimed": reclaimed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--work", type=Path, default=Path("/tmp/envbuild-density-vm"))
    ap.add_argument("--balloon-vms", type=int, default=4)
    ap.add_argument("--only", choices=("pmem", "balloon"))
    args = ap.parse_args()
    store = build(args.work, args.mb)
    node = args.work / "vmnode"
    data_bytes = (args.mb // FILE_MB) * (FILE_MB << 20)
    if args.only != "pmem":
        print(f"{args.balloon_vms} idle microVMs (512 MiB) each allocating and freeing 200 MB "
              f"(load {os.getloadavg()[0]:.2f})")
        for r in (balloon(store, node, args.balloon_vms, False),
                  balloon(store, node, args.balloon_vms, True)):
            print(f"  free page reporting {'on ' if r['reporting'] else 'off'}: host RSS "
                  f"{r['before'] / 1e6:7.1f} MB after boot, {r['peak'] / 1e6:7.1f} MB at the "
                  f"peak, {r['after'] / 1e6:7.1f} MB after the free: "
                  f"{(r['peak'] - r['after']) / 1e6:6.1f} MB given back "
                  f"(info().memory.reclaimed sum {r['reclaimed'] / 1e6:.1f} MB)")
    if args.only == "balloon":
        return
    print(f"{args.vms} microVMs each reading the same {data_bytes / 1e6:.0f} MB "
          f"(load {os.getloadavg()[0]:.2f})")
    results = [measure(store, node, t, args.vms, data_bytes) for t in ("virtio-blk", "pmem-dax")]
    for r in results:
        print(f"  {r['transport']:10}  growth {r['growth'] / 1e6:8.1f} MB = {r['copies']:5.2f} "
              f"copies  (guest RAM {r['anon_after'] / 1e6:7.1f} MB, host page cache "
              f"{r['host_cache_after'] / 1e6:6.1f} MB; MemAvailable drop "
              f"{r['avail_drop_copies']:5.2f} copies)  boot {r['boot_s']:.2f} s/VM, "
              f"read {r['read_s']:.2f} s/VM")
    blk, pmem = results
    print(f"pmem-dax / virtio-blk host memory growth: {pmem['growth'] / blk['growth']:.3f}  "
          f"(goal: pmem-dax <= 1.5 copies: {'met' if pmem['copies'] <= 1.5 else 'NOT met'})")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
