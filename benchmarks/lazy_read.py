"""Lazy reads through the TOC, and push/pull throughput, against S3 servers on loopback.

Goals (the S3 issue), each a ratio against a baseline measured in the same run:

- a workload reading 5 % of a >= 300 MB layer's regular files (by count, random, fixed seed):
  compressed bytes fetched for the files / uncompressed bytes of the files read <= 0.6 (the TOC
  is reported apart), and all bytes fetched (TOC included) <= 8 % of the layer
- time from "nothing on this node" to "all those files read": lazy (``LazyLayer.prefetch`` +
  ``read``) vs full pull + unpack (``copy_blobs`` into a local store + ``LayerReader.unpack``
  + reading the files from disk): >= 5x faster
- push and pull throughput (``sync``'s ``copy_blobs`` LocalStore <-> ``S3Store``) vs plain boto3
  ``upload_file`` / ``download_file`` of the same blob: ratio >= 0.9

Servers: ``moto_server`` (correct, but it reads the whole object for every ranged GET, so lazy
*times* on it are meaningless: reported, not judged) and npm ``s3rver`` 3.7.1 (serves ranges
from files; installed here into benchmarks/.work/s3rver; it gets suffix ranges and If-None-Match
wrong, so the lazy reader is given the blob size and S3Store detects that CAS is unsupported);
``registry``: Debian's docker-registry (lazy reads only; push/pull in registry_push_pull.py).

The layer: the virtualenv with numpy, pandas and django that benchmarks/layer_pack.py makes,
plus the first ~110 MB of its /usr/lib copy (so > 300 MB), packed twice: with the default
``lazy`` framing (files < 16 KiB share ~256 KiB frames) and with one frame per file
(``Framing(small_file=1)``), to show what the framing costs lazy reads.

Usage::

    .venv/bin/python benchmarks/lazy_read.py [--servers moto,s3rver,registry]
                                              [--framings default,per-file]
                                              [--share 0.05] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from layer_pack import WORK, make_usrlib, make_venv  # noqa: E402

from envbuild.layers import (  # noqa: E402
    Framing,  # noqa: E402
    LayerReader,
    pack_tree,
)
from envbuild.store import LocalStore, copy_blobs, digest_file  # noqa: E402
from envbuild.store.lazy import LazyLayer, MemoryChunkCache  # noqa: E402
from envbuild.store.s3 import S3Store  # noqa: E402

MiB = 1 << 20
FRAMINGS = {"default": Framing(), "per-file": Framing(small_file=1)}
S3RVER_VERSION = "3.7.1"
# tmpfs, and not layer_pack.py's scratch dir (it wipes that one)
SCRATCH = (Path("/dev/shm/envbuild-lazy-bench") if Path("/dev/shm").is_dir()
           else WORK / "lazy-scratch")


# -- the tree and the layer -----------------------------------------------------------------

def make_tree() -> Path:
    tree = WORK / "lazy-tree"
    if (tree / ".done").exists():
        return tree
    venv = make_venv(WORK / "venv-tree", ["numpy", "pandas", "django"])
    usrlib = make_usrlib(WORK / "usrlib", None)
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    print("linking the benchmark tree (venv + part of usrlib) ...", flush=True)
    subprocess.run(["cp", "-al", str(venv), str(tree / "venv")], check=True)
    (tree / "venv" / ".done").unlink(missing_ok=True)
    total, limit = 0, 110 * 10**6
    for dirpath, dirnames, filenames in os.walk(usrlib):
        dirnames.sort()
        rel = Path(dirpath).relative_to(usrlib)
        (tree / "usrlib" / rel).mkdir(parents=True, exist_ok=True)
        for n in sorted(filenames):
            src = Path(dirpath) / n
            if total > limit or n == ".done":
                continue
            dst = tree / "usrlib" / rel / n
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            elif src.is_file():
                os.link(src, dst)
                total += src.stat().st_size
    (tree / ".done").write_text("")
    return tree


def make_layer(tree: Path, framing: str) -> Path:
    out = WORK / "lazy" / f"layer-{framing}.tar.zst"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"packing {tree.name} with {framing} framing ...", flush=True)
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pack_tree(tree, f, framing=FRAMINGS[framing])
        tmp.rename(out)
    return out


# -- servers --------------------------------------------------------------------------------

class S3rver:
    """npm s3rver on a free loopback port, data on tmpfs."""

    def __init__(self) -> None:
        from tests.store.s3server import free_port

        self.port = free_port()
        self.data = SCRATCH / "s3rver-data"
        self.proc: subprocess.Popen | None = None

    endpoint = property(lambda self: f"http://127.0.0.1:{self.port}")

    def start(self) -> S3rver:
        prefix = WORK / "s3rver"
        exe = prefix / "node_modules" / ".bin" / "s3rver"
        if not exe.exists():
            print(f"npm install s3rver@{S3RVER_VERSION} ...", flush=True)
            prefix.mkdir(parents=True, exist_ok=True)
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                            f"s3rver@{S3RVER_VERSION}"], check=True, capture_output=True)
        shutil.rmtree(self.data, ignore_errors=True)
        self.data.mkdir(parents=True)
        self.proc = subprocess.Popen(["node", str(exe), "-d", str(self.data), "-a", "127.0.0.1",
                                      "-p", str(self.port), "--silent"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                if self.proc.poll() is not None:  # someone else holds the port
                    raise RuntimeError(f"s3rver exited: port {self.port} taken?")
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("s3rver did not start")

    def kill(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)

    def session(self):
        import boto3

        return boto3.session.Session(aws_access_key_id="S3RVER", aws_secret_access_key="S3RVER",
                                     region_name="us-east-1")


class Moto:
    def __init__(self) -> None:
        from tests.store.s3server import MotoServer

        self.server = MotoServer()

    endpoint = property(lambda self: self.server.endpoint)

    def start(self) -> Moto:
        self.server.start()
        return self

    def kill(self) -> None:
        self.server.kill()

    def session(self):
        from tests.store.s3server import session

        return session()


def client(server):
    from botocore.config import Config

    return server.session().client("s3", endpoint_url=server.endpoint, config=Config(
        s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
        response_checksum_validation="when_required"))


# -- measurements ---------------------------------------------------------------------------

def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def push_pull(server, blob: Path, digest: str, size: int) -> list[tuple[str, str, str]]:
    import boto3.s3.transfer

    c = client(server)
    bucket = "pushpull"
    c.create_bucket(Bucket=bucket)
    local = LocalStore(fresh(SCRATCH / "pp-local"))
    shutil.copyfile(blob, local.blob_path(digest))  # both sides read the same tmpfs file
    rows = []

    # push: ours (LocalStore -> S3Store, streamed, hashed, parallel multipart) vs upload_file
    t = time.perf_counter()
    c.upload_file(str(local.blob_path(digest)), bucket, "baseline/blob",
                  Config=boto3.s3.transfer.TransferConfig())
    base_push = time.perf_counter() - t
    remote = S3Store(bucket, "ours", endpoint_url=server.endpoint, session=server.session())
    t = time.perf_counter()
    copy_blobs(local, remote, [digest])
    ours_push = time.perf_counter() - t

    # pull: ours (S3Store -> LocalStore, one verified streaming GET) vs download_file
    dl = SCRATCH / "pp-download"
    dl.unlink(missing_ok=True)
    t = time.perf_counter()
    c.download_file(bucket, "baseline/blob", str(dl), Config=boto3.s3.transfer.TransferConfig())
    base_pull = time.perf_counter() - t
    dl.unlink()
    dst = LocalStore(fresh(SCRATCH / "pp-pulled"))
    t = time.perf_counter()
    copy_blobs(remote, dst, [digest])
    ours_pull = time.perf_counter() - t
    mb = size / 1e6
    rows.append(("push MB/s: ours vs upload_file", f"{mb / ours_push:.0f} vs {mb / base_push:.0f}",
                 f"ratio {base_push / ours_push:.2f} (goal >= 0.9)"))
    rows.append(("pull MB/s: ours vs download_file", f"{mb / ours_pull:.0f} vs {mb / base_pull:.0f}",
                 f"ratio {base_pull / ours_pull:.2f} (goal >= 0.9)"))
    shutil.rmtree(SCRATCH / "pp-local", ignore_errors=True)
    shutil.rmtree(SCRATCH / "pp-pulled", ignore_errors=True)
    return rows


class Registry:
    """Debian's docker-registry (distribution 2.8) on loopback, data on tmpfs (registry issue:
    the same lazy figures through ``RegistryStore``'s ranged blob GETs)."""

    def start(self) -> Registry:
        from tests.store.registry_server import running_registry

        self._ctx = running_registry(fresh(SCRATCH / "registry"))
        self.reg = self._ctx.__enter__()
        return self

    endpoint = property(lambda self: f"http://{self.reg.host}")

    def kill(self) -> None:
        self._ctx.__exit__(None, None, None)

    def store(self, label: str):
        from envbuild.store.registry import RegistryStore

        return RegistryStore(self.reg.url(f"lazy/{label}"), auth_paths=[])


def lazy_vs_full(server, blob: Path, digest: str, size: int, share: float, seed: int,
                 label: str, judge_time: bool) -> list[tuple[str, str, str]]:
    if isinstance(server, Registry):
        remote = server.store(label)
    else:
        c = client(server)
        bucket = f"lazy-{label}"
        c.create_bucket(Bucket=bucket)
        remote = S3Store(bucket, "layers", endpoint_url=server.endpoint,
                         session=server.session())
    if not remote.exists(digest):
        with open(blob, "rb") as f:
            remote.put(digest, f, size=size)

    with LayerReader.open_file(blob) as r:
        files = [e for e in r.entries() if e.type == "file"]
        toc_digest = r.toc_digest
    sample = random.Random(seed).sample(files, max(1, int(len(files) * share)))
    paths = [e.path for e in sample]
    read_bytes_total = sum(e.size for e in sample)

    # lazy: nothing on this node -> all sampled files read
    t = time.perf_counter()
    lazy = LazyLayer(remote, digest, size=size, expected_toc_digest=toc_digest,
                     chunk_cache=MemoryChunkCache(4 << 30), workers=8)
    lazy.prefetch(paths)
    got = sum(len(lazy.read(p)) for p in paths)
    t_lazy = time.perf_counter() - t
    assert got == read_bytes_total
    s = lazy.stats

    # full: pull the blob, unpack, read the same files from disk
    node = fresh(SCRATCH / "full-node")
    t = time.perf_counter()
    local = LocalStore(node / "store")
    copy_blobs(remote, local, [digest])
    with LayerReader.open_file(local.blob_path(digest), expected_toc_digest=toc_digest) as r:
        r.unpack(node / "root")
    got_full = 0
    for p in paths:
        with open(node / "root" / p, "rb") as f:
            got_full += len(f.read())
    t_full = time.perf_counter() - t
    assert got_full == read_bytes_total
    shutil.rmtree(node, ignore_errors=True)

    data_bytes = s.bytes_fetched - s.toc_bytes
    speed = t_full / t_lazy
    return [
        ("files read / layer files", f"{len(paths)} / {len(files)}",
         f"{read_bytes_total / 1e6:.1f} MB uncompressed"),
        ("requests (footer+TOC, data)", f"{s.requests} (2, {s.requests - 2})",
         f"{s.frames_fetched} frames"),
        ("data fetched / bytes read", f"{data_bytes / 1e6:.1f} / {read_bytes_total / 1e6:.1f} MB",
         f"ratio {data_bytes / read_bytes_total:.2f} (goal <= 0.6)"),
        ("all fetched / layer", f"{s.bytes_fetched / 1e6:.1f} / {size / 1e6:.1f} MB",
         f"{100 * s.bytes_fetched / size:.1f} % (goal <= 8 %), TOC {s.toc_bytes / 1e6:.2f} MB"),
        ("time lazy vs pull+unpack", f"{t_lazy:.2f} s vs {t_full:.2f} s",
         f"{speed:.1f}x faster" + (" (goal >= 5x)" if judge_time else
                                   " (not judged: moto reads whole objects per range)")),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", default="moto,s3rver")
    ap.add_argument("--framings", default="default,per-file")
    ap.add_argument("--share", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for k, v in {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
                 "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}.items():
        os.environ[k] = v
    os.environ.pop("AWS_ENDPOINT_URL", None)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    tree = make_tree()
    layers = {}
    for framing in args.framings.split(","):
        path = make_layer(tree, framing)
        info = digest_file(path)
        with LayerReader.open_file(path) as r:
            usize = r.toc.tar_size
        layers[framing] = (path, info.digest, info.size)
        print(f"layer {framing}: {info.size / 1e6:.1f} MB compressed, {usize / 1e6:.1f} MB tar, "
              f"{info.digest[:19]}", flush=True)
    for name in args.servers.split(","):
        server = {"moto": Moto, "s3rver": S3rver, "registry": Registry}[name]().start()
        try:
            rows: list[tuple[str, str, str]] = []
            first = next(iter(layers.values()))
            if name != "registry":  # registry push/pull: benchmarks/registry_push_pull.py
                rows += push_pull(server, *first)
            for framing, (path, digest, size) in layers.items():
                rows.append((f"-- lazy read, {framing} framing", "", ""))
                rows += lazy_vs_full(server, path, digest, size, args.share, args.seed,
                                     framing, judge_time=name != "moto")
        finally:
            server.kill()
        print(f"\n== {name} ({server.endpoint})")
        for a, b, c in rows:
            print(f"  {a:<34} {b:<28} {c}")


if __name__ == "__main__":
    main()
