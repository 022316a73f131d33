"""The shared Ray cluster fixture really starts two worker nodes with envbuild's resources."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_the_session_cluster_has_two_nodes_offering_envbuild_resources(ray_cluster):
    import ray

    ray.init(address=ray_cluster.address, ignore_reinit_error=True, log_to_driver=False)
    try:
        alive = [n for n in ray.nodes() if n["Alive"]]
        with_node = [n for n in alive if n["Resources"].get("envbuild_node", 0) >= 1]
        assert len(with_node) == 2
        assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in alive)

        @ray.remote(resources={"envbuild_builder": 1})
        def where() -> str:
            return ray.get_runtime_context().get_node_id()

        assert len(set(ray.get([where.remote() for _ in range(16)]))) >= 1
    finally:
        ray.shutdown()
