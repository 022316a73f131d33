#!/usr/bin/env python3
"""Reads of a lazy layer once its files are on the node, against an unpacked layer read in the
same run (issue 13: "native-speed reads after the first fetch").

    .venv/bin/python benchmarks/lazy_native.py [--repeat 3] [--modes passthrough,fuse,meta]

The layer: a slice of this repo's virtualenv (botocore, boto3, moto, flask, aiohttp, yaml,
cryptography and their dependencies, ``__pycache__`` included), packed into a local store.
For each mode a fresh node cache mounts the layer lazily (``NodeCache.ensure_lazy``; the daemon
forced into the mode by ``$ENVBUILD_LAZY_PASSTHROUGH``) and runs two workloads:

- ``import``: ``python3 -c "$IMPORT"`` (boto3, flask, aiohttp, yaml, cryptography, requests)
  with ``PYTHONPATH`` on the layer (what an agent's heavy first command does);
- ``read``: read every regular file of the layer once (``grep -r`` of a workspace).

"cold" is the first run on a fresh mount and daemon (files fetched from the store, verified,
decompressed); "warm" the median of the next ``--repeat`` runs (everything fetched, in the
page cache: the number that must match the unpacked directory); "evicted" the median of
``--repeat`` runs each after the page cache of the files (and of the node's caches) was
dropped with ``POSIX_FADV_DONTNEED``: fetched, on the node's disk, not in memory. The
baseline: the same workloads on the layer unpacked by ``NodeCache.ensure`` (what a full pull
makes), in the same run. Prints seconds, and per mode the ratios warm / unpacked warm and
evicted / unpacked evicted (goal: <= 1.1).

``meta``: passthrough after one pass of both workloads fetched the files, read through a
read-only overlay of the layer's meta layer above its FUSE mount (what a re-run sandbox reads,
``runtime_shim.lazyfs.metalayer``); its "cold" is a first pass through that overlay, files
already fetched. With it comes ``unpacked-ovl``, the unpacked dir through a read-only overlay
(the floor a sandbox actually reads through), and its ratios are printed against both floors.
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

from envbuild.layers import pack_tree  # noqa: E402
from envbuild.store import LocalStore, put_file  # noqa: E402
from runtime_shim.isolation.mount import OverlaySpec, mount_overlay, unmount  # noqa: E402
from runtime_shim.lazyfs.metalayer import meta_dirs  # noqa: E402
from runtime_shim.node.nodecache import NodeCache  # noqa: E402

PACKAGES = ["boto3", "botocore", "moto", "flask", "werkzeug", "jinja2", "markupsafe",
            "itsdangerous", "click", "blinker", "aiohttp", "aiosignal", "aiohappyeyeballs",
            "frozenlist", "multidict", "yarl", "propcache", "attr", "attrs", "yaml", "_yaml",
            "cryptography", "cffi", "_cffi_backend.cpython-311-x86_64-linux-gnu.so",
            "jmespath", "dateutil", "six.py", "typing_extensions.py", "urllib3", "s3transfer", "xmltodict",
            "responses", "requests", "idna", "certifi", "charset_normalizer", "pycparser"]
# (and every *.dist-info: importlib.metadata looks packages up by them)
IMPORT = "import boto3, botocore.session, flask, aiohttp, yaml, cryptography.fernet, requests"
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" \
    / "site-packages"


def make_tree(dest: Path) -> int:
    sp = dest / "site-packages"
    sp.mkdir(parents=True)
    for name in PACKAGES:
        src = SITE / name
        if src.is_dir():
            shutil.copytree(src, sp / name, symlinks=True)
        elif src.exists():
            shutil.copy2(src, sp / name)
    for info in SITE.glob("*.dist-info"):
        shutil.copytree(info, sp / info.name, symlinks=True)
    return sum(1 for _ in sp.rglob("*"))


def workload_import(root: Path) -> float:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": str(root / "site-packages"), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-S", "-c", IMPORT], env=env, check=True)
    return time.perf_counter() - t0


def workload_read(root: Path) -> float:
    t0 = time.perf_counter()
    buf = bytearray(1 << 20)
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p):
                continue
            with open(p, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    return time.perf_counter() - t0


def open_latency(root: Path, n: int = 2000) -> float:
    """Microseconds per open + read + close of one small fetched file (the per-open round
    trip a FUSE mount adds)."""
    small = next(p for p in sorted((root / "site-packages").rglob("*.py"))
                 if 0 < p.stat().st_size < 4096)
    for _ in range(50):
        with open(small, "rb") as f:
            f.read()
    t0 = time.perf_counter()
    for _ in range(n):
        fd = os.open(small, os.O_RDONLY)
        os.read(fd, 4096)
        os.close(fd)
    return (time.perf_counter() - t0) / n * 1e6


def evict(*dirs: Path) -> None:
    """Drop the page cache of every regular file below ``dirs`` (``POSIX_FADV_DONTNEED``):
    the bytes stay on the node's disk, as after memory pressure or on a node whose cache
    outlived the page cache."""
    for d in dirs:
        for dirpath, _dirs, files in os.walk(d):
            for f in files:
                p = os.path.join(dirpath, f)
                if os.path.islink(p):
                    continue
                try:
                    fd = os.open(p, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


WORKLOADS = (("import", workload_import), ("read", workload_read))


def measure(targets: dict[str, tuple[Path, tuple[Path, ...]]], repeat: int
            ) -> dict[str, dict[str, tuple[float, float, float]]]:
    """target -> workload -> (cold: first run; warm: median of ``repeat`` more; evicted:
    median of ``repeat`` runs each after ``evict(root, *cache_dirs)``). Targets take turns
    within each repetition, so that they share the host's load (it changes by the minute on a
    shared machine) and the ratios compare like with like."""
    runs: dict[str, dict[str, list[list[float]]]] = {
        t: {w: [[], [], []] for w, _ in WORKLOADS} for t in targets}
    for t, (root, _) in targets.items():
        for w, fn in WORKLOADS:
            runs[t][w][0].append(fn(root))
    for _ in range(repeat):
        for t, (root, _) in targets.items():
            for w, fn in WORKLOADS:
                runs[t][w][1].append(fn(root))
    for _ in range(repeat):
        for t, (root, caches) in targets.items():
            for w, fn in WORKLOADS:
                evict(root, *caches)
                runs[t][w][2].append(fn(root))
    for t, (root, _) in targets.items():
        print(f"{t:12} {open_latency(root):8.1f} us per open+read+close of a fetched small "
              "file", flush=True)
    return {t: {w: (v[0][0], statistics.median(v[1]), statistics.median(v[2]))
                for w, v in ws.items()} for t, ws in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="passthrough,fuse")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("error: needs root (FUSE mounts)", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="h13-lazy-bench-", dir="/tmp"))
    try:
        tree = work / "tree"
        n = make_tree(tree)
        store = LocalStore(work / "store")
        blob = work / "layer.blob"
        with open(blob, "wb") as f:
            info = pack_tree(tree, f)
        put_file(store, blob)
        usize = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
        print(f"layer: {n} entries, {usize / 1e6:.1f} MB unpacked, {info.size / 1e6:.1f} MB "
              f"packed; repeat {args.repeat}; load {os.getloadavg()[0]:.2f}")
        unpacked = NodeCache(work / "full").ensure(store, info.digest, info.toc_digest)
        targets: dict[str, tuple[Path, tuple[Path, ...]]] = {"unpacked": (Path(unpacked), ())}
        nodes = []
        overlays: list[str] = []

        def overlay(name: str, lowers: list[str]) -> Path:
            """A read-only overlay of ``lowers`` (topmost first): what a sandbox reads."""
            target = work / name
            target.mkdir()
            (work / "empty").mkdir(exist_ok=True)  # the bottom (a sandbox's stub)
            mount_overlay(OverlaySpec(str(target), (*lowers, str(work / "empty"))))
            overlays.append(str(target))
            return target

        try:
            if "meta" in args.modes.split(","):  # the floor a sandbox sees: unpacked + overlay
                targets["unpacked-ovl"] = (overlay("unpacked-ovl", [str(unpacked)]), ())
            for mode in args.modes.split(","):
                if mode == "meta":
                    # passthrough, the files fetched by one pass of both workloads, then the
                    # layer's meta layer above its FUSE mount (runtime_shim.lazyfs.metalayer)
                    os.environ["ENVBUILD_LAZY_PASSTHROUGH"] = "on"
                    node = NodeCache(work / "node-meta")
                    nodes.append(node)
                    mp = node.ensure_lazy(str(store.root), info.digest, info.toc_digest)
                    for _w, fn in WORKLOADS:
                        fn(mp)
                    time.sleep(0.3)
                    t0 = time.perf_counter()
                    meta = meta_dirs(node.root, [(info.digest, str(mp))])[0]
                    print(f"meta layer: {meta or 'none'} in {time.perf_counter() - t0:.3f} s")
                    lowers = [meta, str(mp)] if meta else [str(mp)]
                    targets[mode] = (overlay("meta-ovl", lowers), (node.root / "files",))
                    continue
                # the daemon of each node cache inherits the switch as it starts
                os.environ["ENVBUILD_LAZY_PASSTHROUGH"] = "on" if mode == "passthrough" \
                    else "off"
                node = NodeCache(work / f"node-{mode}")
                nodes.append(node)
                mp = node.ensure_lazy(str(store.root), info.digest, info.toc_digest)
                # the node's copies: passthrough's file cache, the fallback's chunk cache
                targets[mode] = (mp, (node.root / "files", node.root / "chunks"))
            results = measure(targets, args.repeat)
        finally:
            for target in overlays:
                unmount(target)
            for node in nodes:
                node.unmount_lazy(keep=())
        base = results["unpacked"]
        print(f"{'seconds':12} {'import':>8} {'import':>8} {'import':>8} {'read':>8} "
              f"{'read':>8} {'read':>8}   / unpacked: import warm, evicted; read warm, "
              f"evicted")
        print(f"{'':12} {'cold':>8} {'warm':>8} {'evicted':>8} {'cold':>8} {'warm':>8} "
              f"{'evicted':>8}")
        for name, r in results.items():
            ratio = "" if name == "unpacked" else "   " + ", ".join(
                f"{r[w][i] / base[w][i]:.2f}x" for w in ("import", "read") for i in (1, 2))
            print(f"{name:12} " + " ".join(f"{r[w][i]:8.3f}" for w in ("import", "read")
                                           for i in (0, 1, 2)) + ratio)
        ovl = results.get("unpacked-ovl")
        if ovl is not None:
            print("/ unpacked-ovl (the floor through an overlay): import warm, evicted; "
                  "read warm, evicted")
            for name, r in results.items():
                if name not in ("unpacked", "unpacked-ovl"):
                    print(f"{name:12} " + ", ".join(f"{r[w][i] / ovl[w][i]:.2f}x"
                                                    for w in ("import", "read") for i in (1, 2)))
    finally:
        os.environ.pop("ENVBUILD_LAZY_PASSTHROUGH", None)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
