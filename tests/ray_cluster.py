"""One real local Ray cluster per test session, shared by the fleet and the distributed build.

Starting a Ray cluster costs several seconds and ~1 GB of memory on this 2-core host, so every
test that needs one uses the session fixture ``ray_cluster`` (exported from
``tests/conftest.py``): a head that runs no envbuild work plus two worker nodes, each offering
the custom resources ``envbuild_node`` (one fleet node daemon) and ``envbuild_builder`` (build
slots). Tests that kill a node add their own with :meth:`RayTestCluster.add_node` and kill that
one, so the two shared nodes stay up for the rest of the session.

Everything binds to loopback: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray use 127.0.0.1
as every node's address instead of the host's routable one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# Read by Ray when it is first imported, so set here (conftest imports this module before any
# test module can import ray): loopback addresses only, no usage reporting.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray's GCS declares a node dead after 5 failed health checks, one every
# health_check_period_ms (3 s by default): ~15 s after a kill, which the tests that kill a
# node waited out before Ray retried its tasks (test_ray_build) or reported it gone
# (test_fleet). A killed raylet refuses each check at once; a live but slow one still has
# the 10 s timeout of every check, five times over, before it is declared dead.
os.environ.setdefault("RAY_health_check_period_ms", "1000")

#: Resources each shared worker node offers.
WORKER_RESOURCES = {"envbuild_node": 1.0, "envbuild_builder": 2.0}


@dataclass
class RayTestCluster:
    """A running ``ray.cluster_utils.Cluster``; ``address`` is what ``ray.init`` takes."""

    cluster: Any
    temp_dir: str = ""
    workers: list[Any] = field(default_factory=list)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add_node(self, resources: dict[str, float] | None = None, num_cpus: int = 2) -> Any:
        """Start one more worker node (its raylet is a real process) and wait for it."""
        node = self.cluster.add_node(num_cpus=num_cpus, temp_dir=self.temp_dir,
                                     resources=dict(WORKER_RESOURCES if resources is None else resources))
        self.cluster.wait_for_nodes()
        return node

    def kill_node(self, node: Any) -> None:
        """Kill a node's processes at once (SIGKILL), as a lost machine would."""
        self.cluster.remove_node(node, allow_graceful=False)

    def node_id(self, node: Any) -> str:
        return str(node.node_id)

    def shutdown(self) -> None:
        """Disconnect this process's Ray driver, kill every node's processes and remove the
        session dir (and ``RAY_TMPDIR`` when it names it): the one teardown of a cluster."""
        try:
            import ray
            if ray.is_initialized():
                ray.shutdown()
        finally:
            self.cluster.shutdown()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            if os.environ.get("RAY_TMPDIR") == self.temp_dir:
                del os.environ["RAY_TMPDIR"]


def start_cluster(workers: int = 2) -> RayTestCluster:
    """Head (no custom resources) plus ``workers`` worker nodes with :data:`WORKER_RESOURCES`."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        pytest.fail("Ray is not installed (the `fleet` extra); run `bash scripts/setup.sh`", pytrace=False)
    # Ray's session dirs (logs, sockets, spilled objects) under a dir of our own, removed at
    # shutdown, instead of piling up in /tmp/ray; short, for the 107-byte unix socket limit.
    temp_dir = tempfile.mkdtemp(prefix="ebray-", dir="/tmp")
    # Ray (2.60 at least) writes the head's address to <$RAY_TMPDIR or /tmp>/ray/
    # ray_current_cluster whatever temp_dir says, and fails if that directory does not exist
    # (a clean machine that never ran Ray): point it into our dir too, removed with it.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 1, "include_dashboard": False,
                                          "temp_dir": temp_dir})
        test_cluster = RayTestCluster(cluster=cluster, temp_dir=temp_dir)
        for _ in range(workers):
            test_cluster.workers.append(test_cluster.add_node())
    except BaseException:   # a cluster that did not start leaves no process and no dir
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if os.environ.get("RAY_TMPDIR") == temp_dir:
            del os.environ["RAY_TMPDIR"]
        raise
    return test_cluster


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayTestCluster]:
    """The session's shared 2-worker Ray cluster; shut down (every raylet killed) at the end."""
    test_cluster = start_cluster()
    try:
        yield test_cluster
    finally:
        test_cluster.shutdown()
