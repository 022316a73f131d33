"""Helpers for the job-manifest tests: small real envs (layers with TOCs, locks, refs)."""

from __future__ import annotations

from pathlib import Path

from envbuild.layers import pack_to_store
from envbuild.plan.lockspec import LockLayer, RuntimeConfig, make_lock
from envbuild.store import MEDIA_TYPE_CONFIG, digest_bytes, put_json


def make_env(store, tmp: Path, name: str, layers: list[dict[str, bytes]], *,
             ref: str | None = None) -> str:
    """Pack each ``{path: content}`` as a layer, lock them as env ``name`` and point
    ``ref`` (default ``env/<name>``) at the lock; returns the lock digest."""
    lock_layers = []
    for i, files in enumerate(layers):
        src = tmp / f"{name}-layer{i}"
        for path, content in files.items():
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            (src / path).write_bytes(content)
        src.mkdir(parents=True, exist_ok=True)
        info = pack_to_store(src, store)
        lock_layers.append(LockLayer(name=f"{name}-{i}", role="base" if i == 0 else "toolkit",
                                     key=digest_bytes(f"{name}/{i}".encode()),
                                     digest=info.digest, diff_id=info.diff_id, size=info.size,
                                     toc_digest=info.toc_digest))
    lock = make_lock(name, lock_layers, RuntimeConfig(env={"A": "1"}))
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref(ref or f"env/{name}", digest)
    return digest


MANIFEST = """\
apiVersion: envbuild/v1
kind: JobManifest
name: batch-7
groups:
  - name: swe
    lock: env/alpha
    count: 4
    limits: {memory: 1GiB, pids: 64}
  - name: tools
    lock: beta
    backend: microvm
    network: true
"""
