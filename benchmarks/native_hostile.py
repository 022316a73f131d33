#!/usr/bin/env python3
"""What a hostile native lazy layer costs a node, mounted and once its last user is gone
(issue 36, item 3): a layer at the member cap (``--files`` distinct small files, default
261,544 in 512 directories: 262,057 members), made ready on a node as a create does
(``native_layer_dirs``: TOC, source record, placeholders and marks, tree, mount), beside a
small layer that stays mounted (so the filler lives on and must forget the big one); then
``node gc`` (unmount the unused layer, drop its tree: ``NodeCache.evict``; unlink its objects
and record, the filler forgets it: ``collect_objects``).

    sudo .venv/bin/python benchmarks/native_hostile.py [--files 261544] [--keep DIR]

Prints, for the node before the layer, mounted, and after gc: kernel slab (``Slab`` of
/proc/meminfo: tree inodes on tmpfs, placeholder inodes, marks), the filler worker's RSS,
the creating process's peak RSS, the object store's disk use, the tree tmpfs's inodes, and the
after ÷ mounted ratio of each (the baseline is the same node before the layer, in the same
run). Root, a kernel with pre-content events, the node dir on ext4/xfs/btrfs.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envbuild.layers import pack_tree  # noqa: E402
from envbuild.plan.lockspec import LockLayer  # noqa: E402
from envbuild.store import LocalStore, put_file  # noqa: E402
from runtime_shim.lazyfs import collect_objects, describe_objects, native  # noqa: E402
from runtime_shim.node.nodecache import NodeCache  # noqa: E402


def _layer(store: LocalStore, work: Path, name: str, files: int) -> LockLayer:
    tree = work / name
    for i in range(files):
        d = tree / f"d{i % 512:03d}"
        if i < 512:
            d.mkdir(parents=True)
        (d / f"f{i:06d}").write_bytes(b"hostile %d\n" % i)   # distinct: one object each
    blob = work / f"{name}.blob"
    with open(blob, "wb") as out:
        info = pack_tree(tree, out, source_date_epoch=1_700_000_000)
    put_file(store, blob)
    shutil.rmtree(tree)
    return LockLayer(name=name, role="toolkit", key="sha256:" + "0" * 64, digest=info.digest,
                     diff_id=info.diff_id, size=info.size, toc_digest=info.toc_digest)


def _meminfo_mib(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _rss_mib(pid: int | None) -> float:
    if not pid:
        return 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _du_mib(path: str) -> float:
    out = subprocess.run(["du", "-sxk", path], capture_output=True, text=True).stdout
    return int(out.split()[0]) / 1024 if out else 0.0


def _state(root: str) -> dict[str, float]:
    ping = native.filler_request(root, {"op": "ping"}, 5.0) or {}
    trees = os.path.join(root, "meta", "trees")
    tv = os.statvfs(trees) if os.path.ismount(trees) else None
    return {"slab MiB": _meminfo_mib("Slab"), "unreclaimable MiB": _meminfo_mib("SUnreclaim"),
            "filler RSS MiB": _rss_mib(ping.get("pid")),
            "objects on disk MiB": _du_mib(os.path.join(root, "objects")),
            "tree tmpfs inodes": float(tv.f_files - tv.f_ffree) if tv else 0.0,
            "objects": float(describe_objects(root).get("objects", 0))}


def _ready_apart(root: str, store: Path, layer: LockLayer) -> None:
    """``native_layer_dirs`` of ``layer`` in a process of its own (its peak RSS is the
    creating process's: ``RUSAGE_CHILDREN``)."""
    import dataclasses
    import json

    code = ("import json,sys\nfrom envbuild.plan.lockspec import LockLayer\n"
            "from envbuild.store import LocalStore\nfrom runtime_shim.lazyfs import native\n"
            "native.native_layer_dirs(sys.argv[1], LocalStore(sys.argv[2]), "
            "[LockLayer(**json.loads(sys.argv[3]))])\n")
    subprocess.run([sys.executable, "-c", code, root, str(store),
                    json.dumps(dataclasses.asdict(layer))], check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=261_544)
    p.add_argument("--keep", help="work dir (default: a temporary one, removed)")
    args = p.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="hostile-", dir="/var/tmp"))
    store = LocalStore(work / "store")
    t0 = time.monotonic()
    small, big = _layer(store, work, "small", 8), _layer(store, work, "big", args.files)
    print(f"packed {args.files} files in {time.monotonic() - t0:.1f} s; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    root = str(work / "node")
    cache = NodeCache(root)
    try:
        native.native_layer_dirs(root, store, [small])
        base = _state(root)
        t0 = time.monotonic()
        _ready_apart(root, work / "store", big)
        ready = time.monotonic() - t0
        mounted = _state(root)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        t0 = time.monotonic()
        cache.evict([small.digest], 1 << 50)   # the big layer's last user is gone
        done = collect_objects(root)
        gc_s = time.monotonic() - t0
        after = _state(root)
        print(f"made ready in {ready:.1f} s (creating process peak RSS {peak:.0f} MiB); "
              f"node gc {gc_s:.1f} s: {done}; load {os.getloadavg()[0]:.1f}")
        print(f"{'':22}{'before':>10}{'mounted':>10}{'after gc':>10}  (after-before)"
              "/(mounted-before)")
        for k in mounted:
            grown = mounted[k] - base[k]
            ratio = (after[k] - base[k]) / grown if grown else 0.0
            print(f"{k:22}{base[k]:10.1f}{mounted[k]:10.1f}{after[k]:10.1f}  {ratio:.2f}")
    finally:
        cache.evict([], 1 << 50)
        collect_objects(root)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
