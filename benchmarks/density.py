#!/usr/bin/env python3
"""Density (issue 19): FnCall, CPU classes, memory given back; each against a baseline
measured in the same run.

    .venv/bin/python benchmarks/density.py [--env py-textstats] [--store DIR] [--node DIR]
        [--only fncall|cpu|reclaim|vm] [--calls 200] [--execs 300] [--sandboxes 50] [--mb 200]

The container parts live in ``benchmarks/density_containers.py`` (FnCall calls/s against
create → exec → close; p99 of ``exec true`` under CPU-bound best-effort load with and without
CPU classes; N idle sandboxes' memory before/after host-side reclaim). The microVM parts
(8 VMs reading the same 100 MB through the shared page cache vs virtio-blk; 4 idle VMs before /
after balloon reclaim) are ``benchmarks/density_vm.py``, which the microVM work adds with a
``run(args, store, node) -> dict`` of the same shape; until it exists, ``--only vm`` says so.

Needs root, runc and the env built in the store (built first if the store lacks its lock).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import density_containers  # noqa: E402
from _envs import ensure_built  # noqa: E402

from envbuild.store import LocalStore  # noqa: E402


def _has_lock(store_dir: Path, ref: str) -> bool:
    from envbuild.errors import EnvbuildError
    from runtime_shim.node.locks import resolve

    try:
        resolve(LocalStore(store_dir), ref)
    except EnvbuildError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="py-textstats")
    p.add_argument("--store", default=str(REPO / "cache"))
    p.add_argument("--node", default=None, help="node dir (default: a fresh temporary one)")
    p.add_argument("--only", choices=("fncall", "cpu", "reclaim", "vm"))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--execs", type=int, default=300)
    p.add_argument("--sandboxes", type=int, default=50)
    p.add_argument("--mb", type=int, default=200)
    args = p.parse_args(argv)
    store_dir = Path(args.store)
    name = args.env.removeprefix("env/")
    args.env = f"env/{name}"  # the lock's ref
    if not _has_lock(store_dir, args.env):
        ensure_built(store_dir, name)  # envbuild build NAME
    store = LocalStore(store_dir)
    node = Path(args.node or tempfile.mkdtemp(prefix="envbuild-density-"))
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} (1 min)", flush=True)
    if args.only != "vm":
        density_containers.run(args, store, node)
    if args.only in (None, "vm"):
        if importlib.util.find_spec("density_vm") is None:
            print("microVM parts: not here yet (benchmarks/density_vm.py, the microVM work)")
        else:
            import density_vm

            density_vm.run(args, store, node)
    print(f"host load after: {os.getloadavg()[0]:.1f} (1 min)")


if __name__ == "__main__":
    main()
