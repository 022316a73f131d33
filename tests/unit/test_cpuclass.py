"""CPU classes and the reclaim policy: the pure parts (no subprocess)."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import cpuclass
from runtime_shim.isolation.spec import RuntimeSpecRequest, runtime_spec
from runtime_shim.node import reclaim


def test_best_effort_gets_minimum_shares_and_chrt_latency_nothing():
    assert cpuclass.cpu_shares("best-effort") == 2
    assert cpuclass.cpu_shares("latency") is None
    assert cpuclass.wrap_argv(["runc", "run"], "best-effort") == ["chrt", "--idle", "0",
                                                                  "runc", "run"]
    assert cpuclass.wrap_argv(["runc", "run"], "latency") == ["runc", "run"]
    with pytest.raises(RuntimeShimError, match="unknown cpu_class"):
        cpuclass.cpu_shares("realtime")


def test_shares_reach_the_spec_next_to_the_quota():
    spec = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), cpus=1.0,
                                           cpu_shares=2))
    assert spec["linux"]["resources"]["cpu"] == {"quota": 100_000, "period": 100_000,
                                                 "shares": 2}
    plain = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",)))
    assert "cpu" not in plain["linux"]["resources"]


def test_reclaim_policy_from_mapping():
    p = reclaim.ReclaimPolicy.from_mapping({"version": 1, "min_bytes": 1024})
    assert p.min_bytes == 1024 and p.idle_seconds == reclaim.ReclaimPolicy().idle_seconds
    with pytest.raises(RuntimeShimError, match="version"):
        reclaim.ReclaimPolicy.from_mapping({"min_bytes": 1})
    with pytest.raises(RuntimeShimError, match="bad reclaim policy"):
        reclaim.ReclaimPolicy.from_mapping({"version": 1, "idle_seconds": "soon"})
