"""``envbuild plan --changed-since REV`` on K definitions after editing 10 files (issue 15).

Goal: < 5 s for 100,000 definitions. Generates the tree of ``plan_scale.py`` in a git
repository and commits it, fills the parse cache once (a CI runner's previous run), edits 10
workspace files, then measures, each in a fresh process:

- full (the baseline): the path before the fast one, no parse cache, REV checked out in full
  (``git checkout-index``) and loaded, pinned and keyed like the working tree,
- cached: ``plan_changes(defs, None, "HEAD")`` with the node's parse cache: working-tree files
  whose stat is unchanged not read, keys remembered by their inputs, REV as a delta of the
  working tree (only the changed files read from git objects and checked, sources pinned by
  git object id, only the changed definitions and their dependents keyed; see
  ``docs/changed-since.md``),
- cli: ``envbuild plan --changed-since HEAD --json > /dev/null`` end to end, cache warm.

The full and cached runs must report the same rebuild/relock sets; each prints its wall and
CPU seconds (on a shared host the CPU time is the steadier figure) and the load after it
(``--profile`` prints the cached run's top functions).

Usage::

    .venv/bin/python benchmarks/plan_changed_since.py                  # 100,000
    .venv/bin/python benchmarks/plan_changed_since.py --size 10000
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
sys.path.insert(0, str(REPO / "benchmarks"))

GOAL_SECONDS = 5.0
EDITED = 10


def child(defs: str, cache_dir: str | None) -> None:
    from envbuild.build.gitrev import keys_at_revision_checkout, plan_changes
    from envbuild.build.pin import Pinner, snapshot
    from envbuild.defs.parsecache import ParseCache
    from envbuild.plan.changes import diff_keys
    from envbuild.plan.planner import make_plan

    cache = ParseCache(cache_dir) if cache_dir else None
    profile = os.environ.get("BENCH_PROFILE") == "1" and cache is not None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    if cache is None:  # the full path: what plan --changed-since did before the fast path
        pinner = Pinner()
        now = snapshot(Path(defs), pinner)
        plan = make_plan(now.graph, now.pinned, None, None, keys=now.keys)
        changes = diff_keys(keys_at_revision_checkout(Path(defs), "HEAD", pinner), now.keys)
    else:
        plan, changes = plan_changes(Path(defs), None, "HEAD", parse_cache=cache)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert changes is not None
    if profile:
        import pstats
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    print(json.dumps({"seconds": took, "cpu": cpu, "layers": len(plan.layers),
                      "rebuild": list(changes.rebuild), "relock": len(changes.relock),
                      "parsed": cache.misses if cache else None,
                      "reused": cache.hits if cache else None}))


def run_child(defs: Path, cache: Path | None, profile: bool = False) -> dict:
    argv = [sys.executable, __file__, "--child", str(defs)] + ([str(cache)] if cache else [])
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True, timeout=3600,
                         env={**os.environ, "PYTHONPATH": str(REPO),
                              "BENCH_PROFILE": "1" if profile else "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--profile", action="store_true", help="cProfile the cached run")
    args = ap.parse_args()
    from plan_scale import generate

    root = Path(tempfile.mkdtemp(prefix="plan-changed-bench-"))
    try:
        t = time.perf_counter()
        generate(root, args.size)
        git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
        subprocess.run([*git, "init", "-q"], cwd=root, check=True)
        subprocess.run([*git, "add", "-A"], cwd=root, check=True)
        subprocess.run([*git, "commit", "-qm", "tree"], cwd=root, check=True)
        print(f"{args.size} definitions generated and committed in {time.perf_counter() - t:.0f} s;"
              f" load {os.getloadavg()[0]:.2f}", flush=True)
        defs, cache = root / "envdefs", root / "node" / "parse"
        warm = run_child(defs, cache)  # the previous CI run: fills the cache
        print(f"cache fill (first run, nothing edited): {warm['seconds']:.1f} s, "
              f"parsed {warm['parsed']} files, reused {warm['reused']}", flush=True)
        edited = sorted((defs / "workspaces").iterdir())[:EDITED]
        for f in edited:
            f.write_text(f.read_text().replace("pip install --no-deps", "pip install -q --no-deps"))
        base = run_child(defs, None)
        print(f"full (no cache, checkout of REV): {base['seconds']:6.1f} s  (cpu {base['cpu']:.1f} s; "
              f"load {os.getloadavg()[0]:.2f})", flush=True)
        cached = run_child(defs, cache, args.profile)
        print(f"cached, fast path:                {cached['seconds']:6.1f} s  (cpu {cached['cpu']:.1f} s; "
              f"load {os.getloadavg()[0]:.2f}; parsed {cached['parsed']} files, "
              f"reused {cached['reused']})", flush=True)
        assert base["rebuild"] == cached["rebuild"] and len(base["rebuild"]) == EDITED, \
            (base["rebuild"], cached["rebuild"])
        assert base["relock"] == cached["relock"]
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "envbuild.cli", "--defs", str(defs), "--store",
                        str(root / "no-store"), "plan", "--changed-since", "HEAD", "--json"],
                       check=True, stdout=subprocess.DEVNULL, timeout=3600,
                       env={**os.environ, "PYTHONPATH": str(REPO),
                            "ENVBUILD_NODE_CACHE": str(root / "node")})
        cli = time.perf_counter() - t
        print(f"cli, cache warm:                  {cli:6.1f} s  (load {os.getloadavg()[0]:.2f})")
        print(f"{args.size} definitions: {cached['seconds']:.1f} s vs {base['seconds']:.1f} s "
              f"full, speedup {base['seconds'] / cached['seconds']:.1f}x; goal < {GOAL_SECONDS:.0f} s: "
              f"{'ok' if cached['seconds'] < GOAL_SECONDS else 'MISSED'} "
              f"(load {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
