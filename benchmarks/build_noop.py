"""How long does ``envbuild build`` take when every layer is already built (the no-op rebuild)?

Goal: 1,000 layers, everything cached, under 3 s.

Generates a definition tree: one busybox base (``from: {busybox: ...}`` plus one ``network:
none`` run step), ~80 % workspaces with their own tiny ``path`` source (distinct bytes, so
distinct keys: nothing is deduplicated) and no run step, ~20 % toolkits with one ``copy`` step
(no runc either), plus envs of the base, one workspace and one toolkit. Then, all for real:

1. a first build of everything with the CLI (``envbuild build --jobs J``), timed: every layer is
   an overlay mount + copy + pack + store put; only the base runs a container;
2. the no-op rebuild in-process (``load`` = load + pin + keys, then ``build``: plan, key-record
   lookups, re-lock every env), best of ``--repeat``;
3. the no-op rebuild through the CLI in a fresh process (``python -m envbuild.cli build``),
   best of ``--repeat``; it must report every layer ``cached``.

Usage::

    .venv/bin/python benchmarks/build_noop.py                        # 1,000 layers, 200 envs
    .venv/bin/python benchmarks/build_noop.py --layers 200 --envs 50 --jobs 2 --keep
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
sys.path.insert(0, str(REPO))

GOAL_SECONDS = 3.0
TOOLKIT_SHARE = 0.2


def generate(root: Path, layers: int, envs: int) -> tuple[list[str], list[str]]:
    """Write the tree under ``root``; return (workspace names, toolkit names)."""
    defs = root / "envdefs"
    for sub in ("base", "workspaces", "toolkits", "envs", "toolkits/files"):
        (defs / sub).mkdir(parents=True, exist_ok=True)
    (defs / "base" / "bb.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Base\nname: bb\nabi: bb-bench\n"
        "from: {busybox: {binary: /bin/busybox}}\n"
        "steps:\n  - run: mkdir -p /etc /tmp /root && echo bench > /etc/base-id\n"
        "    network: none\n"
        "config: {env: {PATH: /usr/sbin:/usr/bin:/sbin:/bin, HOME: /root}}\n")
    rest = layers - 1
    n_tk = max(1, int(rest * TOOLKIT_SHARE))
    n_ws = rest - n_tk
    workspaces = [f"ws{i:04d}" for i in range(n_ws)]
    toolkits = [f"tk{i:04d}" for i in range(n_tk)]
    for name in workspaces:
        src = root / "sources" / name
        src.mkdir(parents=True)
        (src / "README").write_text(f"workspace {name}\n")
        (src / "main.sh").write_text(f"#!/bin/sh\necho {name}\n")
        (defs / "workspaces" / f"{name}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Workspace\nname: {name}\nbuild_on: bb\n"
            f"source: {{path: ../../sources/{name}}}\ndest: /workspace\n"
            f"check: [sh /workspace/main.sh]\n")
    for name in toolkits:
        (defs / "toolkits" / "files" / name).write_text(f"#!/bin/sh\necho {name}\n")
        (defs / "toolkits" / f"{name}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Toolkit\nname: {name}\nbuild_on: bb\n"
            f"prefix: /opt/toolkits/{name}\n"
            f"steps:\n  - copy: {{src: files/{name}, dest: /opt/toolkits/{name}/bin/{name}, "
            f"mode: \"0755\"}}\n"
            f"config: {{env: {{PATH: /opt/toolkits/{name}/bin:$PATH}}}}\n")
    for j in range(envs):
        (defs / "envs" / f"env{j:04d}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Env\nname: env{j:04d}\nbase: bb\n"
            f"workspace: {workspaces[j % n_ws]}\ntoolkits: [{toolkits[j % n_tk]}]\n"
            f"config: {{workdir: /workspace, user: \"0:0\"}}\n")
    return workspaces, toolkits


def cli_env(root: Path) -> dict[str, str]:
    return {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
            "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(root / "envdefs")}


def cli_build(root: Path, jobs: int) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "envbuild.cli", "build", "--json", "--jobs", str(jobs)]
    t = time.perf_counter()
    out = subprocess.run(argv, env=cli_env(root), cwd=REPO, capture_output=True,
                         text=True)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        sys.exit(f"envbuild build failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return seconds, json.loads(out.stdout)


def in_process_build(root: Path, jobs: int) -> tuple[float, float, dict[str, int]]:
    """(seconds to load, seconds to build, status counts) of one build in this process."""
    from envbuild.build.engine import build, load
    from envbuild.cli.main import App
    from envbuild.settings import Settings

    settings = Settings(defs_dir=root / "envdefs", store_url=str(root / "store"),
                        node_dir=root / "node", jobs=jobs)
    t = time.perf_counter()
    project = load(settings.defs_dir)
    loaded = time.perf_counter() - t
    ctx = App(settings).build_context()
    t = time.perf_counter()
    report = build(project, ctx, jobs=jobs)
    built = time.perf_counter() - t
    if not report.ok:
        sys.exit(f"in-process build failed: {[o.name for o in report.failed]}")
    counts: dict[str, int] = {}
    for o in report.layers:
        counts[o.status] = counts.get(o.status, 0) + 1
    return loaded, built, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1000, help="layer definitions (default 1000)")
    ap.add_argument("--envs", type=int, default=200, help="envs to lock (default 200)")
    ap.add_argument("--jobs", type=int, default=2, help="build parallelism (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="no-op runs per mode, best is kept")
    ap.add_argument("--dir", type=Path, default=None, help="work here (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (overlay mounts, runc)")

    root = args.dir or Path(tempfile.mkdtemp(prefix="envbuild-noop-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        workspaces, toolkits = generate(root, args.layers, args.envs)
        print(f"generated 1 base + {len(workspaces)} workspaces + {len(toolkits)} toolkits "
              f"= {args.layers} layers, {args.envs} envs in {time.perf_counter() - t:.1f}s "
              f"({root})", flush=True)

        seconds, report = cli_build(root, args.jobs)
        statuses = [lay["status"] for lay in report["layers"]]
        assert statuses.count("built") == args.layers, statuses
        layer_seconds = sorted(lay["seconds"] for lay in report["layers"])
        print(f"first build (CLI, --jobs {args.jobs}): {seconds:.1f}s for {args.layers} layers "
              f"= {seconds / args.layers * 1000:.0f} ms/layer wall; per layer median "
              f"{layer_seconds[len(layer_seconds) // 2] * 1000:.0f} ms, max "
              f"{layer_seconds[-1] * 1000:.0f} ms", flush=True)

        best_load = best_build = float("inf")
        for _ in range(args.repeat):
            loaded, built, counts = in_process_build(root, args.jobs)
            assert counts == {"cached": args.layers}, counts
            if loaded + built < best_load + best_build:
                best_load, best_build = loaded, built
        in_proc = best_load + best_build
        print(f"no-op in-process: {in_proc:.2f}s (load+pin+keys {best_load:.2f}s, "
              f"build: plan + {args.layers} key records + {args.envs} locks {best_build:.2f}s)"
              f"  goal {GOAL_SECONDS:.0f}s  ratio {in_proc / GOAL_SECONDS:.2f}", flush=True)

        best_cli = float("inf")
        for _ in range(args.repeat):
            seconds, report = cli_build(root, args.jobs)
            assert {lay["status"] for lay in report["layers"]} == {"cached"}
            assert all(lk["digest"] for lk in report["locks"])
            best_cli = min(best_cli, seconds)
        print(f"no-op CLI (fresh process): {best_cli:.2f}s  goal {GOAL_SECONDS:.0f}s  "
              f"ratio {best_cli / GOAL_SECONDS:.2f}", flush=True)
    finally:
        if not args.keep and args.dir is None:
            _cleanup(root)


def _cleanup(root: Path) -> None:
    # Nothing should be mounted after a clean run; unmount defensively before deleting.
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if line.split()[4].startswith(str(root))]
    for m in sorted(mounts, reverse=True):
        subprocess.run(["umount", "-l", m], check=False)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
