#!/usr/bin/env python3
"""Trusted grading against a plain sandbox lifecycle, measured in the same run (issue 35).

    .venv/bin/python benchmarks/grade.py [--n 50] [--root DIR]

The task is ``tests/grading_task.py``'s (``calc.mean`` on the ``pyhost`` Python env of
``tests/py_env.py``, built under ``--root`` on first use): N agent sandboxes each write a
solution (half honest, half broken) and then, interleaved one by one so that the host's drift
hits both alike:

- **grade**: ``runtime_shim.grade(task, sandbox_id)`` — read and filter the agent's changes
  (frozen), pack and store the change set, a fresh sandbox of env + changes + hidden layer,
  the grade command, its JUnit report, the verdict recorded in the store;
- **plain**: what a trainer without the grader pays for the same answer: ``Sandbox.create``
  of a lock with the hidden tests already in it, write the solution, exec the same grade
  command, close.

Both are measured twice: with the task's pytest command (what RL grading costs), and with a
grade command of ``true`` (the grader's own overhead, nothing to hide behind). Prints p50 /
p95 of each and the ratio grade / plain. Goal: ratio of the p50s <= 1.5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _stats import pct  # noqa: E402

from runtime_shim import Limits, Sandbox, grade  # noqa: E402
from runtime_shim.node import TaskSpec, load_task, publish_task  # noqa: E402
from runtime_shim.node.packdiff import derive_lock, publish_lock  # noqa: E402
from tests.grading_task import BROKEN, HONEST, RUN, publish_calc_tasks  # noqa: E402
from tests.py_env import make_py_tree  # noqa: E402

#: agents' sandboxes: a small disk, so N of them fit the node's disk budget
AGENT_LIMITS = Limits(disk_bytes=512 << 20)


def _quick_task(tree) -> str:
    """``task/calc-true``: the same env and hidden layer, a grade command of ``true``."""
    base = load_task(tree.store, "task/calc-empty")
    spec = TaskSpec(name="calc-true", env_lock=base.spec.env_lock, workdir="/workspace",
                    run="true", timeout=60, editable=("/workspace/calc",))
    publish_task(tree.store, spec, base.hidden, ref="task/calc-true")
    return "task/calc-true"


def _plain_lock(tree) -> str:
    """The env lock with the hidden layer on top: what a trainer grading without the grader
    would start its sandboxes from."""
    from runtime_shim.node import resolve

    task = load_task(tree.store, "task/calc-empty")
    env = resolve(tree.store, task.spec.env_lock)
    manifest, config = derive_lock(env, [{**task.hidden.to_json(), "name": "hidden"}],
                                   keep=len(env.layers))
    return publish_lock(tree.store, manifest, config, "bench/plain-grading")


def _one_pair(tree, task: str, run: str, plain: str, solution: str) -> tuple[float, float, bool]:
    with Sandbox.create(task, store=tree.store, node_dir=tree.node, limits=AGENT_LIMITS) as sb:
        sb.write_file("/workspace/calc/core.py", solution)
        started = time.monotonic()
        verdict = grade(task, sb.id, store=tree.store, node_dir=tree.node)
        graded = time.monotonic() - started
    started = time.monotonic()
    with Sandbox.create(plain, store=tree.store, node_dir=tree.node,
                        limits=Limits(disk_bytes=2 << 30)) as sb:
        sb.write_file("/workspace/calc/core.py", solution)
        sb.exec(["/bin/sh", "-c", run], cwd="/workspace", timeout=120)
    return graded, time.monotonic() - started, verdict.passed


def measure(tree, task: str, run: str, plain: str, n: int) -> dict[str, list[float]]:
    grades, plains, passed = [], [], []
    for i in range(n):
        g, p, ok = _one_pair(tree, task, run, plain, HONEST if i % 2 == 0 else BROKEN)
        grades.append(g)
        plains.append(p)
        passed.append(ok)
    if run != "true" and passed != [i % 2 == 0 for i in range(n)]:
        raise SystemExit(f"wrong verdicts: {passed}")
    return {"grade": grades, "plain": plains}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="submissions graded (default 50)")
    parser.add_argument("--root", default=None, help="where the env is built (default: tmp)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-grade-"))
    tree = make_py_tree(root)
    publish_calc_tasks(tree)
    plain = _plain_lock(tree)
    quick = _quick_task(tree)
    _one_pair(tree, quick, "true", plain, HONEST)   # warm the node cache
    print(f"{'':34} {'p50 ms':>8} {'p95 ms':>8}   (n={args.n}, interleaved)")
    for label, task, run in (("pytest grade command", "task/calc-empty", RUN),
                             ("grade command `true`", quick, "true")):
        times = measure(tree, task, run, plain, args.n)
        g50, p50 = statistics.median(times["grade"]), statistics.median(times["plain"])
        print(f"{'grade  (' + label + ')':34} {g50 * 1e3:8.1f} {pct(times['grade'], 95) * 1e3:8.1f}")
        print(f"{'plain  (' + label + ')':34} {p50 * 1e3:8.1f} {pct(times['plain'], 95) * 1e3:8.1f}")
        print(f"  ratio grade / plain p50 {g50 / p50:.2f} (goal <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
