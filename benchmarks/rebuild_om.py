"""The O(m) rule as a number: m base updates cost m builds, not m·N.

Setup (all real builds with runc, no network): m busybox bases sharing one abi, each with a
``network: none`` run step; N workspaces, each with its own tiny ``path`` source and one run
step (a ``sha256sum`` over its files, standing in for "install"), built on the bases round
robin; m·N envs, every workspace on every base (the abi allows it).

- **envbuild**: build everything, then change every base's step (same abi) and rebuild. Counted
  from ``envbuild build --json``: must be exactly m builds (N workspaces ``cached``), and every
  one of the m·N envs is re-locked onto its new base. Timed end to end (CLI, fresh process).
- **Dockerfile-style chain**: the same workspaces, but one image per (workspace, base) pair whose
  cache key is its base's digest — exactly ``FROM base`` + ``COPY`` + ``RUN``, written as
  envbuild layers with ``pin: digest`` (which keys a layer on its base chain's keys instead of
  the abi). Built for real in its own store on the old bases, then the same base update is
  applied and rebuilt: every image misses, m + m·N builds, same step costs as above because it
  is the same executor running the same steps. ``--chain-sample K`` builds only K of the N
  workspaces per base and extrapolates the rebuild time linearly (×N/K; the count is exact
  arithmetic: m + m·N); ``--chain-sample N`` (or 0) builds the whole chain.

Usage::

    .venv/bin/python benchmarks/rebuild_om.py                       # m=5, N=200, sample 40
    .venv/bin/python benchmarks/rebuild_om.py --chain-sample 0      # the whole m·N chain
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ABI = "om-bench"


def write_bases(defs: Path, m: int, revision: str) -> list[str]:
    (defs / "base").mkdir(parents=True, exist_ok=True)
    names = [f"base{b}" for b in range(m)]
    for name in names:
        (defs / "base" / f"{name}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Base\nname: {name}\nabi: {ABI}\n"
            "from: {busybox: {binary: /bin/busybox}}\n"
            "steps:\n"
            f"  - run: mkdir -p /etc /tmp /root && echo '{name} {revision}' > /etc/base-id\n"
            "    network: none\n"
            "config: {env: {PATH: /usr/sbin:/usr/bin:/sbin:/bin, HOME: /root}}\n")
    return names


def write_sources(root: Path, n: int) -> list[str]:
    names = [f"ws{i:03d}" for i in range(n)]
    for name in names:
        src = root / "sources" / name
        src.mkdir(parents=True, exist_ok=True)
        (src / "README").write_text(f"workspace {name}\n")
        (src / "main.sh").write_text(f"#!/bin/sh\necho {name}\n")
    return names


WS_STEP = ("steps:\n  - run: cd /workspace && sha256sum README main.sh > SUMS\n"
           "    network: none\n")


def write_envbuild_tree(root: Path, m: int, n: int) -> None:
    defs = root / "envdefs"
    bases = write_bases(defs, m, "r1")
    workspaces = write_sources(root, n)
    (defs / "workspaces").mkdir(parents=True, exist_ok=True)
    (defs / "envs").mkdir(parents=True, exist_ok=True)
    for i, ws in enumerate(workspaces):
        (defs / "workspaces" / f"{ws}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Workspace\nname: {ws}\nbuild_on: {bases[i % m]}\n"
            f"source: {{path: ../../sources/{ws}}}\ndest: /workspace\n{WS_STEP}")
        for base in bases:
            env = f"{ws}-{base}"
            (defs / "envs" / f"{env}.yaml").write_text(
                f"apiVersion: envbuild/v1\nkind: Env\nname: {env}\nbase: {base}\n"
                f"workspace: {ws}\nconfig: {{workdir: /workspace, user: \"0:0\"}}\n")


def write_chain_tree(root: Path, m: int, n: int) -> None:
    """One layer per (workspace, base), keyed on the base's digest: a Dockerfile per image."""
    defs = root / "envdefs"
    bases = write_bases(defs, m, "r1")
    workspaces = write_sources(root, n)
    (defs / "workspaces").mkdir(parents=True, exist_ok=True)
    for ws in workspaces:
        for base in bases:
            (defs / "workspaces" / f"{ws}-on-{base}.yaml").write_text(
                f"apiVersion: envbuild/v1\nkind: Workspace\nname: {ws}-on-{base}\n"
                f"build_on: {base}\npin: digest\n"
                f"source: {{path: ../../sources/{ws}}}\ndest: /workspace\n{WS_STEP}")


def cli_build(root: Path, jobs: int) -> tuple[float, dict]:
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
           "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(root / "envdefs")}
    argv = [sys.executable, "-m", "envbuild.cli", "build", "--json", "--jobs", str(jobs)]
    t = time.perf_counter()
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True,
                         text=True)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        sys.exit(f"envbuild build failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return seconds, json.loads(out.stdout)


def built(report: dict) -> int:
    return sum(lay["status"] == "built" for lay in report["layers"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bases", "-m", type=int, default=5)
    ap.add_argument("--workspaces", "-n", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--chain-sample", type=int, default=40,
                    help="workspaces per base really built in the chain (0 = all N)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (overlay mounts, runc)")
    m, n = args.bases, args.workspaces
    k = n if args.chain_sample in (0, n) else min(args.chain_sample, n)

    root = Path(tempfile.mkdtemp(prefix="envbuild-om-"))
    try:
        # --- envbuild: abi-keyed workspaces ---------------------------------------------
        eb = root / "envbuild"
        write_envbuild_tree(eb, m, n)
        first_s, first = cli_build(eb, args.jobs)
        assert built(first) == m + n, built(first)
        print(f"envbuild  first build: {built(first)} layers ({m} bases + {n} workspaces), "
              f"{len(first['locks'])} envs locked in {first_s:.1f}s", flush=True)
        before = {lk["env"]: lk["digest"] for lk in first["locks"]}
        write_bases(eb / "envdefs", m, "r2")
        eb_s, update = cli_build(eb, args.jobs)
        eb_builds = built(update)
        statuses = {lay["name"]: lay["status"] for lay in update["layers"]}
        assert eb_builds == m and all(statuses[f"base{b}"] == "built" for b in range(m)), statuses
        relocked = sum(lk["digest"] != before[lk["env"]] for lk in update["locks"])
        assert relocked == m * n, relocked
        layer_s = max(lay["seconds"] for lay in update["layers"] if lay["status"] == "built")
        print(f"envbuild  base update: {eb_builds} builds, {n} workspaces cached, "
              f"{relocked} envs re-locked in {eb_s:.1f}s (slowest base build {layer_s:.2f}s; "
              f"the rest is start-up, planning and re-locking)", flush=True)

        # --- Dockerfile-style chain: every image keyed on its base's digest ----------------
        ch = root / "chain"
        write_chain_tree(ch, m, k)
        c_first_s, c_first = cli_build(ch, args.jobs)
        assert built(c_first) == m + m * k, built(c_first)
        print(f"chain     first build: {built(c_first)} layers ({m} bases + {m}×{k} images) "
              f"in {c_first_s:.1f}s", flush=True)
        write_bases(ch / "envdefs", m, "r2")
        c_s, c_update = cli_build(ch, args.jobs)
        assert built(c_update) == m + m * k, built(c_update)
        chain_builds = m + m * n  # every image misses: its FROM changed
        chain_s = c_s * n / k
        how = ("measured" if k == n else
               f"measured {built(c_update)} builds in {c_s:.1f}s on a sample of {k} of {n} "
               f"workspaces per base, extrapolated ×{n / k:g}")
        print(f"chain     base update: {chain_builds} builds in {chain_s:.1f}s ({how})",
              flush=True)

        print()
        print(f"m={m} bases, N={n} workspaces, {m * n} envs/images, --jobs {args.jobs}")
        print(f"{'':<22}{'builds':>8}{'seconds':>10}")
        print(f"{'envbuild (abi keys)':<22}{eb_builds:>8}{eb_s:>10.1f}")
        print(f"{'Dockerfile chain':<22}{chain_builds:>8}{chain_s:>10.1f}")
        print(f"ratio (chain/envbuild): builds {chain_builds / eb_builds:.0f}×, "
              f"time {chain_s / eb_s:.1f}×")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            with open("/proc/self/mountinfo") as f:
                mounts = [ln.split()[4] for ln in f if ln.split()[4].startswith(str(root))]
            for mnt in sorted(mounts, reverse=True):
                subprocess.run(["umount", "-l", mnt], check=False)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
