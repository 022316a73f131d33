"""Cold start of a sandbox from S3: lazy (FUSE, files fetched on first read) vs full pull + unpack.

The env (> 300 MB unpacked): the ``debian-bookworm`` and ``debian-bookworm-py311`` base layers
from the local store ``cache/`` (``envbuild build`` makes them) plus a virtualenv layer at
``/opt/venv`` with numpy, pandas and django (the tree ``benchmarks/layer_pack.py`` makes, its
interpreter links pointed at the base's ``/usr/bin/python3``). Everything is pushed to npm
``s3rver`` 3.7.1 on loopback (it serves ranges from files; moto re-reads the whole object per
ranged GET, so it would time the server, not us), via ``benchmarks/lazy_read.py``'s ``S3rver``.

Per run, a fresh node dir on tmpfs (the exec agent built beforehand by a throwaway busybox
sandbox, so neither mode pays for it) and, timed from "nothing of the env on this node":

- ``full``: ``Sandbox.create(lock, store=S3Store)`` — envbuild's normal path: each layer streamed
  from S3 and unpacked into the node cache — then the first command;
- ``lazy``: ``Sandbox.create(..., lazy=True)`` with no lazy profile in the store — the node's
  FUSE daemon mounts each layer (footer + TOC), then the first command, which fetches only the
  files it opens (this run records the profile; it is dropped before the next ``lazy`` run);
- ``lazy-profile``: the same with the profile a previous lazy run of the lock recorded (one
  untimed run records it if none exists): the daemon prefetches those files in the background
  from the mount on;
- ``lazy-warm``: a second lazy sandbox on the same node (daemons, chunk cache and page cache up).

Reported: time to the first command's exit (``python3 -c 'import json'``), then a second,
heavier command (``import numpy, pandas, django``), and the bytes fetched: for ``full`` the
blobs, for ``lazy`` what the daemons' ``LazyStats`` counted (footer, TOC and frames) plus the
manifest and config; ``lo`` is every byte that crossed loopback meanwhile (HTTP included).

Usage::

    .venv/bin/python benchmarks/cold_start.py [--repeat 3] [--modes full,lazy,lazy-profile]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from layer_pack import SCRATCH, WORK, make_venv  # noqa: E402

from envbuild.layers import LayerReader, pack_tree  # noqa: E402
from envbuild.oci import MEDIA_TYPE_CONFIG  # noqa: E402
from envbuild.plan.lockspec import LockLayer, RuntimeConfig, make_lock, merge_config  # noqa: E402
from envbuild.store import LocalStore, copy_blobs, open_store, put_file, put_json  # noqa: E402
from runtime_shim.lazyfs import PROFILE_NAMESPACE, lazy_stats  # noqa: E402
from runtime_shim.locks import resolve  # noqa: E402
from runtime_shim.nodecache import NodeCache  # noqa: E402
from runtime_shim.sandbox import Sandbox  # noqa: E402

COLD = WORK / "cold"
FIRST = ["/opt/venv/bin/python3", "-c", "import json"]
SECOND = ["/opt/venv/bin/python3", "-c", "import numpy, pandas, django"]
MB = 1e6


def venv_layer(local: LocalStore) -> LockLayer:
    """numpy + pandas + django at /opt/venv, on the base's python3 (packed once)."""
    tree = COLD / "tree"
    if not (tree / ".done").exists():
        src = make_venv(WORK / "venv-tree", ["numpy", "pandas", "django"])
        shutil.rmtree(tree, ignore_errors=True)
        (tree / "opt").mkdir(parents=True)
        subprocess.run(["cp", "-al", str(src), str(tree / "opt" / "venv")], check=True)
        venv = tree / "opt" / "venv"
        (venv / ".done").unlink(missing_ok=True)
        for name in ("python", "python3", "python3.11"):  # replace, never write through links
            (venv / "bin" / name).unlink(missing_ok=True)
        os.symlink("/usr/bin/python3", venv / "bin" / "python3")
        os.symlink("python3", venv / "bin" / "python")
        os.symlink("python3", venv / "bin" / "python3.11")
        (venv / "pyvenv.cfg").unlink()
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = "
                                         "false\nversion = 3.11\n")
        (tree / ".done").write_text("")
    blob = COLD / "venv.layer"
    if not blob.exists():
        print("packing the venv layer ...", flush=True)
        with open(blob.with_suffix(".tmp"), "wb") as f:
            pack_tree(tree, f, source_date_epoch=0)
        blob.with_suffix(".tmp").rename(blob)
    info = put_file(local, blob)
    with LayerReader.open_file(blob) as r:
        return LockLayer(name="venv", role="toolkit", key="sha256:" + "0" * 64,
                         digest=info.digest, diff_id=r.toc.diff_id, size=info.size,
                         toc_digest=r.toc_digest)


def lock_into(store, name: str, layers: list[LockLayer]) -> str:
    lock = make_lock(name, layers, merge_config([RuntimeConfig()]))
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref(f"env/{name}", digest)
    return digest


def lo_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])  # received (= sent, on loopback)
    return 0


class Counting:
    """The store, counting the bytes this process reads from it."""

    def __init__(self, store) -> None:
        self._store = store
        self.bytes = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def get_range(self, digest, offset, length):
        data = self._store.get_range(digest, offset, length)
        self.bytes += len(data)
        return data

    def get(self, digest):
        data = self._store.get(digest)
        read = data.read

        def counted(*a):
            chunk = read(*a)
            self.bytes += len(chunk)
            return chunk
        data.read = counted
        return data


def drop_profiles(store) -> None:
    for name in store.list_records(PROFILE_NAMESPACE):
        store.delete_record(PROFILE_NAMESPACE, name)


def one_run(store, lock: str, warm_lock: str, mode: str, run: int) -> dict:
    node_dir = SCRATCH / f"cold-node-{mode}-{run}"
    shutil.rmtree(node_dir, ignore_errors=True)
    lazy = mode.startswith("lazy")
    if mode == "lazy":  # no profile: this run records one, dropped afterwards
        drop_profiles(store)
    elif mode == "lazy-profile" and not store.list_records(PROFILE_NAMESPACE):
        print("  recording the lazy profile (untimed run) ...", flush=True)
        one_run(store, lock, warm_lock, "lazy", run)
    with Sandbox.create(warm_lock, store=store, node_dir=node_dir) as sb:  # exec agent, stub
        sb.exec(["true"])
    counting = Counting(store)
    lo0 = lo_bytes()
    t0 = time.perf_counter()
    sb = Sandbox.create(lock, store=counting, node_dir=node_dir, lazy=lazy)
    t_create = time.perf_counter() - t0
    try:
        r = sb.exec(FIRST)
        t_first = time.perf_counter() - t0
        assert r.exit_code == 0, r.stderr
        node = NodeCache(node_dir / "node")
        layers = resolve(store, lock).layers

        def fetched() -> int:
            if not lazy:
                return counting.bytes
            return counting.bytes + sum(lazy_stats(node.lazy_dir(x.digest))["bytes_fetched"]
                                        for x in layers)
        def requests() -> int:
            return sum(lazy_stats(node.lazy_dir(x.digest))["requests"] for x in layers) \
                if lazy else 0
        b_first, lo_first, req_first = fetched(), lo_bytes() - lo0, requests()
        t1 = time.perf_counter()
        r = sb.exec(SECOND)
        t_second = time.perf_counter() - t1
        assert r.exit_code == 0, r.stderr
        out = {"mode": mode, "create": t_create, "first": t_first, "second": t_second,
               "bytes_first": b_first, "lo_first": lo_first, "bytes_second": fetched(),
               "requests_first": req_first, "requests_second": requests()}
        if lazy:  # a second sandbox on this node: mounts, chunk and page cache up
            t2 = time.perf_counter()
            with Sandbox.create(lock, store=store, node_dir=node_dir, lazy=True) as sb2:
                assert sb2.exec(FIRST).exit_code == 0
            out["warm_first"] = time.perf_counter() - t2
    finally:
        sb.close()
        for log in (node_dir / "node" / "lazy").glob("*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if " ERROR " in line or " WARNING " in line or line.startswith("error"):
                    print(f"  {log.name[:12]}: {line}", flush=True)
        NodeCache(node_dir / "node").evict((), 0)  # the daemon saves the profile, exits
        shutil.rmtree(node_dir, ignore_errors=True)
    if mode == "lazy":
        out["profiled"] = len(store.list_records(PROFILE_NAMESPACE))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="full,lazy,lazy-profile")
    args = ap.parse_args()
    from lazy_read import S3rver

    COLD.mkdir(parents=True, exist_ok=True)
    cache = LocalStore(REPO / "cache")
    bases = [x for x in resolve(cache, "py-minicalc").layers if x.role == "base"]
    venv = venv_layer(cache)
    layers = [LockLayer(name=x.name, role=x.role, key=x.key, digest=x.digest, diff_id=x.diff_id,
                        size=x.size, toc_digest=x.toc_digest) for x in bases] + [venv]
    busybox = resolve(cache, "busybox-shell").layers
    warm = [LockLayer(name=x.name, role=x.role, key=x.key or "sha256:" + "0" * 64,
                      digest=x.digest, diff_id=x.diff_id, size=x.size,
                      toc_digest=x.toc_digest) for x in busybox]
    unpacked = 0
    for x in layers:
        with LayerReader.open_file(cache.blob_path(x.digest)) as r:
            unpacked += r.toc.tar_size
    print(f"env: {len(layers)} layers, {sum(x.size for x in layers) / MB:.0f} MB compressed, "
          f"{unpacked / MB:.0f} MB of tar", flush=True)

    server = S3rver()
    server.data = SCRATCH / f"s3rver-cold-{os.getpid()}"  # not the shared default: other
    server.start()                                        # benchmarks wipe that one
    os.environ.update({"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    try:
        import boto3

        boto3.session.Session().client("s3", endpoint_url=server.endpoint).create_bucket(
            Bucket="cold")
        store = open_store("s3://cold/envs", s3_endpoint=server.endpoint)
        print("pushing to s3rver ...", flush=True)
        copy_blobs(cache, store, [x.digest for x in layers + warm])
        lock = lock_into(store, "cold", layers)
        warm_lock = lock_into(store, "warm", warm)
        rows = []
        for run in range(args.repeat):
            for mode in args.modes.split(","):
                row = one_run(store, lock, warm_lock, mode, run)
                rows.append(row)
                lazy = mode.startswith("lazy")
                print(f"  run {run} {mode:<5} create {row['create']:.2f} s, first command "
                      f"exits at {row['first']:.2f} s, second {row['second']:.2f} s, "
                      f"{row['bytes_first'] / MB:.1f} MB fetched"
                      + (f", {row['requests_first']} + {row['requests_second']} requests"
                         if lazy else ""), flush=True)
    finally:
        server.kill()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode and key in r)

    print("\nmedian of", args.repeat, "runs")
    print(f"{'mode':<14}{'create s':>10}{'1st exit s':>12}{'2nd cmd s':>11}{'MB at 1st':>11}"
          f"{'lo MB':>9}{'MB after 2nd':>14}")
    for mode in args.modes.split(","):
        print(f"{mode:<14}{med(mode, 'create'):>10.2f}{med(mode, 'first'):>12.2f}"
              f"{med(mode, 'second'):>11.2f}{med(mode, 'bytes_first') / MB:>11.1f}"
              f"{med(mode, 'lo_first') / MB:>9.1f}{med(mode, 'bytes_second') / MB:>14.1f}")
    for mode in [m for m in args.modes.split(",") if m.startswith("lazy")]:
        print(f"{mode}, second sandbox on the same node (mounts up): first exit "
              f"{med(mode, 'warm_first'):.3f} s; requests to 1st exit "
              f"{med(mode, 'requests_first'):.0f}, after 2nd {med(mode, 'requests_second'):.0f}")
        if "full" in args.modes:
            print(f"{mode} vs full: first command's exit {med('full', 'first') / med(mode, 'first'):.1f}x "
                  f"faster, second command {med('full', 'second') / med(mode, 'second'):.2f}x, "
                  f"{med('full', 'bytes_first') / max(med(mode, 'bytes_first'), 1):.0f}x fewer "
                  f"bytes at the first exit")


if __name__ == "__main__":
    main()
