"""A busybox-tiny env with random data files at /data, built with the real CLI: shared by the
microVM pmem tests and ``benchmarks/density_vm.py`` (both need layers of a known size whose
bytes they can check in the guest)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from envbuild.store import LocalStore

REPO = Path(__file__).resolve().parent.parent
BUSYBOX_DEFS = ("envdefs/base/busybox-tiny.yaml", "envdefs/base/files/busybox")

_WORKSPACE = """apiVersion: envbuild/v1
kind: Workspace
name: {name}data
build_on: busybox-tiny
source: {{path: ../../sources/{name}data}}
dest: /data
steps:
  - run: "true"
    network: none
"""
_ENV = """apiVersion: envbuild/v1
kind: Env
name: {name}
base: busybox-tiny
workspace: {name}data
config: {{workdir: /data, user: "0:0"}}
"""


def build_data_env(root: Path, name: str, files: int, file_bytes: int, *, seed: int = 19,
                   timeout: float = 300) -> tuple[LocalStore, Path, dict[str, str]]:
    """Env ``name`` (busybox-tiny + ``files`` random files of ``file_bytes`` at /data) built
    into ``root/store`` with the node cache ``root/node``: the store, the node dir and
    ``{file name: sha256}``. ``root`` must not hold an earlier tree."""
    for rel in BUSYBOX_DEFS:
        src, dst = REPO / rel, root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    (root / "envdefs/workspaces").mkdir()
    (root / "envdefs/envs").mkdir()
    (root / f"envdefs/workspaces/{name}data.yaml").write_text(_WORKSPACE.format(name=name))
    (root / f"envdefs/envs/{name}.yaml").write_text(_ENV.format(name=name))
    data = root / f"sources/{name}data"
    data.mkdir(parents=True)
    rng = random.Random(seed)
    digests = {}
    for i in range(files):
        blob = rng.randbytes(file_bytes)
        (data / f"f{i:03d}.bin").write_bytes(blob)
        digests[f"f{i:03d}.bin"] = hashlib.sha256(blob).hexdigest()
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
           "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(root / "envdefs"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "envbuild.cli", "build", name], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"building {name} failed:\n{proc.stderr[-4000:]}")
    return LocalStore(root / "store"), root / "node", digests
