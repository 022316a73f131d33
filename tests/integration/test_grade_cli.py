"""``envbuild grade`` as a user runs it (a fresh process): a kept sandbox or a snapshot ref
graded, ``--json``, the exit status (0 passed, 3 not passed, 1 error) and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime_shim import Sandbox
from tests.conftest import require_root, require_tool
from tests.grading_task import BROKEN, HONEST, publish_calc_tasks
from tests.py_env import make_py_tree

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    require_root()
    require_tool("runc")
    t = make_py_tree(tmp_path_factory.mktemp("grade-cli"))
    publish_calc_tasks(t)
    return t


def _envbuild(tree, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "envbuild.cli", *args], env=tree.env(),
                          capture_output=True, text=True, timeout=300)


def test_grade_a_kept_sandbox_and_a_snapshot(tree):
    sb = Sandbox.create("task/calc-empty", store=tree.store, node_dir=tree.node, keep=True)
    try:
        sb.write_file("/workspace/calc/core.py", HONEST)
        r = _envbuild(tree, "grade", "task/calc-empty", "--from", sb.id, "--json")
        assert r.returncode == 0, r.stderr
        verdict = json.loads(r.stdout)
        assert verdict["passed"] is True and verdict["version"] == "envbuild.verdict.v1"
        assert verdict["source"] == sb.id and verdict["record"].startswith("sha256:")
        sb.write_file("/workspace/calc/core.py", BROKEN)
        sb.write_file("/usr/bin/python3.11", "#!/bin/busybox sh\necho '3 passed'\n", 0o755)
        r = _envbuild(tree, "pack-diff", sb.id, "--publish", "snap/cheat")
        assert r.returncode == 0, r.stderr
    finally:
        sb.close()
    r = _envbuild(tree, "grade", "task/calc-empty", "--from", "snap/cheat")
    assert r.returncode == 3, r.stderr
    assert r.stdout.startswith("FAILED ")
    assert "dropped /usr/bin/python3.11: outside the editable paths" in r.stdout
    assert "failed: tests/test_hidden.py::test_empty" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("task/nope", "--from", "snap/cheat"), "no task lock named 'task/nope'"),
    (("task/calc-empty", "--from", "snap/nope"), "no lock named 'snap/nope'"),
    (("env/py-calc", "--from", "snap/nope"), "is not a task lock"),
])
def test_bad_input_is_one_line_and_exit_1(tree, args, message):
    r = _envbuild(tree, "grade", *args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error")]) == 1, r.stderr


def test_a_recorded_verdict_keeps_what_it_graded_through_gc(tree):
    """The record is an OCI artifact under verdict/TASK/ID: its config is the verdict, its layer
    the change set; gc keeps both (and the grading lock, a plain unreferenced lock, goes)."""
    from envbuild.store import get_json

    with Sandbox.create("task/calc-empty", store=tree.store, node_dir=tree.node) as sb:
        sb.write_file("/workspace/calc/core.py", HONEST)
        r = _envbuild(tree, "grade", "task/calc-empty", "--from", sb.id, "--json")
    verdict = json.loads(r.stdout)
    store = tree.store
    refs = [ref for ref in store.list_refs() if ref.startswith("verdict/calc-empty/")]
    assert verdict["record"] in {store.get_ref(ref).digest for ref in refs}
    r = _envbuild(tree, "gc", "--grace", "0s", "--drop-cache")
    assert r.returncode == 0, r.stderr
    manifest = get_json(store, verdict["record"])
    assert manifest["artifactType"] == "application/vnd.envbuild.verdict.v1"
    assert manifest["layers"][0]["digest"] == verdict["change_set"]
    assert store.exists(verdict["change_set"])
    recorded = get_json(store, manifest["config"]["digest"])
    assert recorded["passed"] is True and recorded["change_set"] == verdict["change_set"]
    assert not store.exists(verdict["grading_lock"])
