"""How long do ``validate`` and ``plan --json`` take on K definitions, and how much memory?

Goal (the issue): 10,000 definitions in < 10 s, 100,000 in < 100 s, peak RSS < 4 GB.

For each size K this generates a definition tree on disk with a realistic mix — a few bases
(one stacked on another), ~55 % workspaces with ``path`` sources over a small set of shared
source directories (so pinning is cached, as in a real repo where many workspaces share
checkouts), ~15 % toolkits with their own prefixes and a ``copy`` step, ~30 % envs of a base, a
workspace and 1–3 toolkits — one YAML file per definition. Then, each in a fresh process so peak
RSS is per size:

- ``validate``: ``load_definitions`` + ``build_graph`` (what ``envbuild validate`` checks),
- ``plan``: load + graph + pin + keys + plan + JSON, in-process through the library,
- ``cli``: ``envbuild --defs DIR plan --json > /dev/null`` end to end, once per size.

Usage::

    .venv/bin/python benchmarks/plan_scale.py                 # 1,000 10,000 100,000
    .venv/bin/python benchmarks/plan_scale.py --sizes 1000,10000 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_SECONDS_PER_DEF = 10 / 10_000  # 10k in 10 s, 100k in 100 s
GOAL_RSS_MB = 4096
N_BASES = 4
N_SOURCES = 50


def generate(root: Path, k: int) -> None:
    """Write ``k`` definitions (plus shared sources) under ``root``."""
    defs = root / "envdefs"
    for sub in ("base", "workspaces", "toolkits", "envs", "files"):
        (defs / sub).mkdir(parents=True, exist_ok=True)
    for s in range(N_SOURCES):
        src = root / "sources" / f"src{s}" / "pkg"
        src.mkdir(parents=True, exist_ok=True)
        for f in range(20):
            (src / f"mod{f}.py").write_text(f"# source {s} module {f}\n" + "x = 1\n" * 50)
    (defs / "files" / "tool.cfg").write_text("setting = 1\n")

    bases = [f"base{b}" for b in range(N_BASES)]
    for b, name in enumerate(bases):
        src = "{base: base0}" if b == 1 else "{debootstrap: {suite: bookworm, variant: minbase}}"
        (defs / "base" / f"{name}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Base\nname: {name}\nabi: abi{b % 2}\n"
            f"from: {src}\nsteps:\n  - run: apt-get install -y python3 git\n"
            f"config: {{env: {{LANG: C.UTF-8}}}}\n")
    rest = k - N_BASES
    n_tk = max(1, rest * 15 // 100)
    n_env = max(1, rest * 30 // 100)
    n_ws = max(1, rest - n_tk - n_env)
    for w in range(n_ws):
        (defs / "workspaces" / f"ws{w:06d}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Workspace\nname: ws{w:06d}\n"
            f"build_on: {bases[w % N_BASES]}\n"
            f"source: {{path: ../../sources/src{w % N_SOURCES}}}\ndest: /workspace\n"
            f"steps:\n  - run: pip install --no-deps -e /workspace  # {w}\n"
            f"check: [python3 -c 'import pkg']\n")
    for t in range(n_tk):
        (defs / "toolkits" / f"tk{t:06d}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Toolkit\nname: tk{t:06d}\n"
            f"build_on: {bases[t % N_BASES]}\nrequires: {{abi: [abi0, abi1]}}\n"
            f"prefix: /opt/toolkits/tk{t:06d}\n"
            f"steps:\n  - copy: {{src: ../files/tool.cfg, dest: /opt/toolkits/tk{t:06d}/tool.cfg}}\n"
            f"  - run: echo {t} > /opt/toolkits/tk{t:06d}/id\n"
            f"config: {{env: {{PATH: '/opt/toolkits/tk{t:06d}/bin:$PATH'}}}}\n")
    for e in range(n_env):
        w = e % n_ws
        tks = sorted({f"tk{(e * 7 + i) % n_tk:06d}" for i in range(1 + e % 3)})
        (defs / "envs" / f"env{e:06d}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Env\nname: env{e:06d}\n"
            f"base: {bases[w % N_BASES]}\nworkspace: ws{w:06d}\ntoolkits: [{', '.join(tks)}]\n"
            f"config: {{workdir: /workspace}}\n")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(defs_dir: str, phase: str, profile: bool) -> None:
    """One phase in this (fresh) process; print a JSON line with seconds and peak RSS."""
    from envbuild.build.pin import pin_inputs
    from envbuild.defs import load_definitions
    from envbuild.plan.graph import build_graph
    from envbuild.plan.keys import compute_keys
    from envbuild.plan.planner import make_plan

    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    times = {}
    t0 = time.perf_counter()
    defs = load_definitions(defs_dir)
    times["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    graph = build_graph(defs)
    times["graph"] = time.perf_counter() - t
    if phase == "plan":
        t = time.perf_counter()
        pinned = pin_inputs(defs)
        times["pin"] = time.perf_counter() - t
        t = time.perf_counter()
        keys = compute_keys(graph, pinned)
        times["keys"] = time.perf_counter() - t
        t = time.perf_counter()
        plan = make_plan(graph, pinned, None, None, keys=keys)
        times["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        with open(os.devnull, "w") as f:
            f.write(json.dumps(plan.to_json(), indent=2))
        times["json"] = time.perf_counter() - t
    total = time.perf_counter() - t0
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    print(json.dumps({"total": total, "phases": times, "rss_mb": _peak_rss_mb()}))


def run_child(defs_dir: Path, phase: str, profile: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", phase, str(defs_dir)]
                         + (["--profile"] if profile else []),
                         check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cli(defs_dir: Path) -> dict:
    envbuild = Path(sys.executable).with_name("envbuild")
    argv = [str(envbuild)] if envbuild.exists() else [sys.executable, "-m", "envbuild.cli"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    subprocess.run(argv + ["--defs", str(defs_dir), "plan", "--json"], check=True,
                   stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all children so far; report it only if it grew.
    return {"total": seconds, "rss_mb": max(peak, before) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--workdir", help="Keep generated trees here (default: a temp dir).")
    ap.add_argument("--profile", action="store_true", help="cProfile the plan phase to stderr.")
    ap.add_argument("--no-cli", action="store_true", help="Skip the end-to-end CLI run.")
    ap.add_argument("--child", nargs=2, metavar=("PHASE", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[1], args.child[0], args.profile)
        return

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="plan-scale-"))
    print(f"{'K':>8} {'step':<9} {'seconds':>9} {'goal s':>8} {'ratio':>6} {'peak MB':>8}  phases")
    try:
        for k in (int(s) for s in args.sizes.split(",")):
            root = work / f"k{k}"
            if not (root / "envdefs").is_dir():
                t = time.perf_counter()
                generate(root, k)
                print(f"{k:>8} generate  {time.perf_counter() - t:9.2f}", flush=True)
            goal = k * GOAL_SECONDS_PER_DEF
            rows = [("validate", run_child(root / "envdefs", "validate", False)),
                    ("plan", run_child(root / "envdefs", "plan", args.profile))]
            if not args.no_cli:
                rows.append(("cli plan", run_cli(root / "envdefs")))
            for step, r in rows:
                phases = " ".join(f"{p}={s:.2f}" for p, s in r.get("phases", {}).items())
                mem = "" if r["rss_mb"] < GOAL_RSS_MB else " OVER 4 GB"
                print(f"{k:>8} {step:<9} {r['total']:9.2f} {goal:8.1f} {r['total'] / goal:6.2f} "
                      f"{r['rss_mb']:8.0f}  {phases}{mem}", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
