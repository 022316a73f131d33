"""How long does the ``envbuild`` CLI take to start, against a bare interpreter?

Goal (issue 12, item 10): ``envbuild --version`` and ``envbuild layer ls FILE`` each start in
under 3× a bare ``python -c pass`` of the same interpreter, measured in the same run.

Each command runs ``--runs`` times in a fresh process (after ``--warmup`` runs to fill the page
cache), alternating between the commands so drift hits all of them alike, hyperfine-style; the
table shows mean, min and standard deviation, and the ratio of each mean to the bare
interpreter's mean. The CLI runs as ``python -m envbuild.cli`` with this checkout first on
``PYTHONPATH`` (what the console script does, without the entry-point shim). The layer is a
small one packed into a temporary directory beforehand. Bytecode is cached (in a temporary
``PYTHONPYCACHEPREFIX``) as for an installed package, also when the caller's environment sets
``PYTHONDONTWRITEBYTECODE``.

Also prints the ten slowest imports of ``import envbuild.cli.main`` (``python -X importtime``),
so a regression names its culprit.

Usage::

    .venv/bin/python benchmarks/cli_startup.py                # 30 runs each
    .venv/bin/python benchmarks/cli_startup.py --runs 100 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOAL_RATIO = 3.0


def _run_once(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return elapsed


def _slowest_imports(env: dict[str, str], n: int = 10) -> list[tuple[int, str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import envbuild.cli.main"],
                          env=env, capture_output=True, text=True, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="cli-startup-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        # Bytecode as an installed package has it (pip compiles at install): without this, a
        # PYTHONDONTWRITEBYTECODE=1 environment recompiles every envbuild module on every run.
        # The cache goes to a temporary directory, so the checkout stays clean.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        src = Path(tmp) / "src"
        (src / "etc").mkdir(parents=True)
        (src / "etc" / "hello").write_text("hello\n")
        layer = Path(tmp) / "layer.tar.zst"
        subprocess.run([py, "-m", "envbuild.cli", "layer", "pack", str(src), "-o", str(layer)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        imports = _slowest_imports(env)
        commands = {
            "python -c pass": [py, "-c", "pass"],
            "envbuild --version": [py, "-m", "envbuild.cli", "--version"],
            "envbuild layer ls FILE": [py, "-m", "envbuild.cli", "layer", "ls", str(layer)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.warmup):
            for argv in commands.values():
                _run_once(argv, env)
        for _ in range(args.runs):
            for name, argv in commands.items():
                times[name].append(_run_once(argv, env))

    base = statistics.mean(times["python -c pass"])
    results = {name: {"mean_ms": statistics.mean(t) * 1e3, "min_ms": min(t) * 1e3,
                      "stdev_ms": statistics.stdev(t) * 1e3 if len(t) > 1 else 0.0,
                      "ratio": statistics.mean(t) / base}
               for name, t in times.items()}
    ok = all(r["ratio"] < GOAL_RATIO for name, r in results.items() if name != "python -c pass")
    if args.json:
        print(json.dumps({"runs": args.runs, "goal_ratio": GOAL_RATIO, "ok": ok,
                          "results": results,
                          "slowest_imports_us": [[us, mod.strip()] for us, mod in imports]},
                         indent=1))
    else:
        print(f"{'command':<26}{'mean':>9}{'min':>9}{'stdev':>9}{'ratio':>8}   ({args.runs} runs)")
        for name, r in results.items():
            print(f"{name:<26}{r['mean_ms']:>7.1f}ms{r['min_ms']:>7.1f}ms"
                  f"{r['stdev_ms']:>7.1f}ms{r['ratio']:>7.2f}x")
        print(f"goal: every envbuild command < {GOAL_RATIO:.0f}x python -c pass: "
              f"{'met' if ok else 'NOT met'}")
        print("slowest imports of envbuild.cli.main (cumulative):")
        for us, mod in imports:
            print(f"  {us / 1e3:7.1f} ms {mod}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
