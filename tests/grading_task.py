"""A small gradable task on the ``pyhost`` Python env (``tests/py_env.py``), for the grading
tests and ``benchmarks/grade.py``: a package ``calc`` whose ``mean`` fails on an empty list,
the project's own test (``tests/test_core.py``, must keep passing) and a hidden test
(``tests/test_hidden.py``, must pass) that only the grading sandbox has.

``HONEST`` fixes ``mean``; ``BROKEN`` leaves it failing. Two task locks share the env:
``task/calc-empty`` (the agent may change ``calc/`` only) and ``task/calc-open`` (the whole
workdir, as a task with no ``editable`` gets: the name rules must hold there too).
"""

from __future__ import annotations

from pathlib import Path

from envbuild.layers import pack_tree
from envbuild.store import put_file
from runtime_shim.node import HiddenLayer, TaskSpec, publish_task
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


def publish_hidden(tree: PyTree, files: dict[str, str]) -> HiddenLayer:
    """A hidden layer of ``files`` (absolute paths → text), packed and stored."""
    root = tree.root / "hidden-tree"
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    blob = tree.root / "hidden.tar.zst"
    with open(blob, "wb") as out:
        info = pack_tree(root, out)
    put_file(tree.store, blob)
    return HiddenLayer(digest=info.digest, size=info.size, diff_id=info.diff_id,
                       toc_digest=info.toc_digest)


def publish_calc_tasks(tree: PyTree) -> dict[str, str]:
    """Build the env and publish ``task/calc-empty`` and ``task/calc-open``; their digests."""
    env_lock = build_calc_env(tree)
    hidden = publish_hidden(tree, {"/workspace/tests/test_hidden.py": TEST_HIDDEN})
    digests = {}
    for name, editable in (("calc-empty", ("/workspace/calc",)), ("calc-open", ("/workspace",))):
        spec = TaskSpec(name=name, env_lock=env_lock, workdir="/workspace", run=RUN,
                        timeout=120, editable=editable, must_pass=MUST_PASS,
                        keep_passing=KEEP_PASSING, junit=JUNIT)
        digests[name] = publish_task(tree.store, spec, hidden, ref=f"task/{name}")
    return digests


def solution_path(tree: PyTree) -> Path:
    return tree.defs / "sources" / "calc" / "calc" / "core.py"
