"""The shared Ray cluster fixture really starts two worker nodes with envbuild's resources."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_the_session_cluster_has_two_nodes_offering_envbuild_resources(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=ray_cluster.address, ignore_reinit_error=True, log_to_driver=False)
    try:
        alive = [n for n in ray.nodes() if n["Alive"]]
        with_node = [n for n in alive if n["Resources"].get("envbuild_node", 0) >= 1]
        assert len(with_node) == 2
        assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in alive)

        @ray.remote(resources={"envbuild_builder": 1})
        def where() -> str:
            return ray.get_runtime_context().get_node_id()

        # one build-slot task pinned to each worker node (one worker process each: they
        # cost seconds to start here); each runs there
        workers = sorted(ray_cluster.node_id(n) for n in ray_cluster.workers)
        ran = ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            w, soft=False)).remote() for w in workers])
        assert sorted(ran) == workers
    finally:
        ray.shutdown()
