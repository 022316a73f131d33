"""A small gradable task on the ``pyhost`` Python env (``tests/py_env.py``), for the grading
tests and ``benchmarks/grade.py``: a package ``calc`` whose ``mean`` fails on an empty list,
the project's own test (``tests/test_core.py``, must keep passing) and a hidden test
(``tests/test_hidden.py``, must pass) that only the grading sandbox has.

``HONEST`` fixes ``mean``; ``BROKEN`` leaves it failing. Two tasks share the env, defined as
YAML and locked by ``envbuild build``: ``task/calc-empty`` (the agent may change ``calc/``
only) and ``task/calc-open`` (the whole workdir: the name rules must hold there too).
"""

from __future__ import annotations

from pathlib import Path

from runtime_shim.node.locks import resolve
from tests.py_env import PyTree

CORE = "def mean(xs):\n    return sum(xs) / len(xs)\n"
HONEST = "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n"
BROKEN = "def mean(xs):\n    return sum(xs) / (len(xs) or 1) + 1\n"
TEST_CORE = "from calc.core import mean\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n"
TEST_HIDDEN = ("from calc.core import mean\n\n\ndef test_empty():\n    assert mean([]) == 0.0\n\n\n"
               "def test_one():\n    assert mean([4]) == 4\n")
JUNIT = "/tmp/envbuild-grade/junit.xml"
RUN = f"python3 -m pytest -q -p no:cacheprovider --junitxml={JUNIT} tests/test_hidden.py tests/test_core.py"
MUST_PASS = ("tests/test_hidden.py::test_empty", "tests/test_hidden.py::test_one")
KEEP_PASSING = ("tests/test_core.py::test_mean",)


def build_calc_env(tree: PyTree) -> str:
    """Build the ``py-calc`` env in ``tree``; its lock digest."""
    tree.write("sources/calc/calc/__init__.py", "")
    tree.write("sources/calc/calc/core.py", CORE)
    tree.write("sources/calc/tests/test_core.py", TEST_CORE)
    tree.write("workspaces/calc.yaml", """\
        apiVersion: envbuild/v1
        kind: Workspace
        name: calc
        build_on: pyhost
        source: {path: ../sources/calc}
        dest: /workspace
        """)
    tree.write("envs/py-calc.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: py-calc
        base: pyhost
        workspace: calc
        config: {workdir: /workspace}
        """)
    tree.cli("build", "py-calc")
    return resolve(tree.store, "env/py-calc").digest


TASK_YAML = """\
apiVersion: envbuild/v1
kind: Task
name: {name}
env: py-calc
workdir: /workspace
hidden: {{path: ../hidden/calc}}
editable: [{editable}]
grade: {{run: "{run}", timeout: 120}}
tests:
  must_pass: [{must_pass}]
  keep_passing: [{keep_passing}]
junit: {junit}
"""


def publish_calc_tasks(tree: PyTree) -> dict[str, str]:
    """Define ``task/calc-empty`` and ``task/calc-open`` on the ``py-calc`` env, build and
    lock them with the real CLI (``envbuild build``: the env, the hidden layer, the task
    locks); their task lock digests."""
    build_calc_env(tree)
    tree.write("hidden/calc/tests/test_hidden.py", TEST_HIDDEN)
    for name, editable in (("calc-empty", "calc"), ("calc-open", ".")):
        tree.write(f"tasks/{name}.yaml", TASK_YAML.format(
            name=name, editable=editable, run=RUN, must_pass=", ".join(MUST_PASS),
            keep_passing=", ".join(KEEP_PASSING), junit=JUNIT))
    tree.cli("build", "calc-empty", "calc-open")
    return {name: tree.store.get_ref(f"task/{name}").digest
            for name in ("calc-empty", "calc-open")}


def solution_path(tree: PyTree) -> Path:
    return tree.defs / "sources" / "calc" / "calc" / "core.py"
