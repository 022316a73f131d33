"""Push and pull of a ~300 MB lock to a registry: envbuild's ``sync`` with ``RegistryStore`` vs
``skopeo copy`` of the same image, each against its own fresh Debian ``docker-registry`` on
127.0.0.1 (so neither can reuse or mount the other's blobs).

Goal (issue 16): envbuild's throughput >= 1.0x skopeo's, for push and for pull.

The lock: a config and ``--layers`` layers of random (incompressible) bytes, ``--size`` MB in
all, in a local store (an OCI layout that skopeo reads as ``oci:DIR:env/bench``). Layer contents
do not matter to a copy; both tools hash every byte.

Usage::

    .venv/bin/python benchmarks/registry_push_pull.py [--size 300] [--layers 3] [--jobs 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envbuild.store import LocalStore, put_bytes, put_json  # noqa: E402
from envbuild.store.base import MEDIA_TYPE_CONFIG, MEDIA_TYPE_LAYER_ZSTD  # noqa: E402
from envbuild.store.registry import RegistryStore  # noqa: E402
from envbuild.store.sync import sync  # noqa: E402
from tests.store.registry_server import running_registry  # noqa: E402


def make_lock(store: LocalStore, size_mb: int, n_layers: int) -> int:
    layers = []
    for _ in range(n_layers):
        data = os.urandom(size_mb * (1 << 20) // n_layers)
        layers.append({"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": put_bytes(store, data),
                       "size": len(data)})
    config = put_json(store, {"architecture": "amd64", "os": "linux",
                              "rootfs": {"type": "layers",
                                         "diff_ids": [x["digest"] for x in layers]}},
                      media_type=MEDIA_TYPE_CONFIG)
    manifest = put_json(store, {"schemaVersion": 2,
                                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                "config": config.to_oci(), "layers": layers})
    store.put_ref("env/bench", manifest.digest)
    return sum(x["size"] for x in layers)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=300, help="MB of layers")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=4, help="blobs in flight (envbuild push/pull)")
    args = ap.parse_args()
    skopeo = shutil.which("skopeo") or sys.exit("skopeo is not installed")
    work = Path(tempfile.mkdtemp(prefix="registry-bench-"))
    try:
        src = LocalStore(work / "src")
        total = make_lock(src, args.size, args.layers)
        mb = total / 1e6
        with running_registry(work / "reg-envbuild") as reg_e, \
                running_registry(work / "reg-skopeo") as reg_s:
            push_e = timed(lambda: sync(src, RegistryStore(reg_e.url("bench/envs")),
                                        refs=["env/bench"], jobs=args.jobs))
            push_s = timed(lambda: subprocess.run(
                [skopeo, "copy", "-q", "--dest-tls-verify=false", f"oci:{src.root}:env/bench",
                 f"docker://{reg_s.host}/bench/envs:bench"], check=True))
            pull_e = timed(lambda: sync(RegistryStore(reg_e.url("bench/envs")),
                                        LocalStore(work / "pulled-envbuild"),
                                        refs=["env/bench"], jobs=args.jobs))
            pull_s = timed(lambda: subprocess.run(
                [skopeo, "copy", "-q", "--src-tls-verify=false",
                 f"docker://{reg_s.host}/bench/envs:bench",
                 f"oci:{work / 'pulled-skopeo'}:bench"], check=True))
        print(f"lock: {args.layers} layers, {mb:.0f} MB")
        for what, e, s in (("push", push_e, push_s), ("pull", pull_e, pull_s)):
            print(f"{what}: envbuild {e:.2f} s ({mb / e:.0f} MB/s), skopeo copy {s:.2f} s "
                  f"({mb / s:.0f} MB/s): {s / e:.2f}x skopeo's throughput (goal >= 1.0)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
