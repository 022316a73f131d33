"""Shared by the benchmarks that start sandboxes: make sure an example env is built."""

from __future__ import annotations

import subprocess
from pathlib import Path

from envbuild.errors import EnvbuildError
from envbuild.store import LocalStore
from runtime_shim.node.locks import resolve

REPO = Path(__file__).resolve().parent.parent


def ensure_built(store_dir: Path, env: str) -> None:
    """Build and lock ``env`` from envdefs/ into ``store_dir`` unless its lock is there."""
    try:
        resolve(LocalStore(store_dir), env)
    except EnvbuildError:
        print(f"building {env} into {store_dir} first …", flush=True)
        subprocess.run([str(REPO / ".venv/bin/envbuild"), "--store", str(store_dir), "build",
                        env], check=True, cwd=REPO)
