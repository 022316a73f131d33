"""Grading through the fleet and from asyncio (issue 35, item 3): a fleet sandbox of a task is
graded on its own node (``FleetSandbox.grade``, ``AsyncFleetSandbox.grade``), and a local one
with ``grade_async``, on the session's real Ray cluster and real runc sandboxes."""

from __future__ import annotations

import asyncio

import pytest

from runtime_shim import Sandbox, grade_async
from runtime_shim.node.model import Limits
from tests.grading_task import BROKEN, HONEST, publish_calc_tasks
from tests.py_env import make_py_tree

pytestmark = pytest.mark.integration

LIMITS = Limits(disk_bytes=None, memory_bytes=256 << 20, pids=64, nofile=256)
FAKE_PASS = "#!/bin/busybox sh\necho '3 passed'\nexit 0\n"


@pytest.fixture(scope="module")
def fleet_tree(ray_cluster, tmp_path_factory):
    import ray

    from runtime_shim.fleet import Fleet

    root = tmp_path_factory.mktemp("grade-fleet")
    tree = make_py_tree(root / "tree")
    publish_calc_tasks(tree)
    ray.init(address=ray_cluster.address, namespace="envbuild", log_to_driver=False,
             ignore_reinit_error=True)
    fleet = Fleet.connect(address=ray_cluster.address, store=str(tree.store_dir),
                          node_dir=str(root / "nodes" / "{node_id}"), slots=8)
    try:
        yield tree, fleet
    finally:
        fleet.stop_daemons()


def test_a_fleet_sandbox_is_graded_on_its_node(fleet_tree):
    tree, fleet = fleet_tree
    [honest, cheat] = fleet.create("task/calc-empty", n=2, limits=LIMITS)
    try:
        honest.write_file("/workspace/calc/core.py", HONEST)
        cheat.write_file("/workspace/calc/core.py", BROKEN)
        cheat.write_file("/usr/bin/python3.11", FAKE_PASS, 0o755)
        verdict = honest.grade("task/calc-empty")
        assert verdict.passed, verdict.output
        assert honest.id.split("@")[0] == verdict.source and verdict.record  # ID@NODE
        forged = asyncio.run(cheat.aio().grade("task/calc-empty"))
        assert not forged.passed
        assert {d["path"] for d in forged.dropped} >= {"/usr/bin/python3.11"}
        # the verdicts are in the fleet's store
        assert tree.store.stat(verdict.record).size > 0
    finally:
        honest.close()
        cheat.close()


def test_grade_async_grades_many_at_once(fleet_tree):
    tree, _ = fleet_tree

    async def main() -> list[bool]:
        boxes = [Sandbox.create("task/calc-empty", store=tree.store, node_dir=tree.node,
                                limits=Limits(disk_bytes=1 << 30)) for _ in range(3)]
        try:
            for sb, solution in zip(boxes, (HONEST, BROKEN, HONEST)):
                sb.write_file("/workspace/calc/core.py", solution)
            verdicts = await asyncio.gather(*(
                grade_async("task/calc-empty", sb.id, store=tree.store, node_dir=tree.node)
                for sb in boxes))
            return [v.passed for v in verdicts]
        finally:
            for sb in boxes:
                sb.close()

    assert asyncio.run(main()) == [True, False, True]
