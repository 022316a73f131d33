"""Fleet placement (``runtime_shim.fleet.placement``) is pure: spread by free capacity,
locality within each node's fair share, warm sandboxes first, all or ``fleet-full``."""

from __future__ import annotations

import pickle

import pytest

from envbuild.errors import NodeLost, RuntimeShimError, SandboxNotFound
from runtime_shim.fleet.daemon import CreateSpec, fleet_id, split_fleet_id
from runtime_shim.fleet.placement import Group, NodeLoad, plan, plan_groups
from runtime_shim.node.model import Limits

BIG = 1 << 40


def nodes(*loads: tuple[str, int, int], cached: dict[str, set[str]] | None = None):
    cached = cached or {}
    return [NodeLoad(node_id=n, slots=s, used=u, memory_bytes=BIG, memory_used=0,
                     cached=frozenset(cached.get(n, ()))) for n, s, u in loads]


def test_one_group_spreads_evenly_over_cold_nodes():
    assert plan(nodes(("a", 256, 0), ("b", 256, 0)), 50, {"l1": 10}) == {"a": 25, "b": 25}


def test_spread_fills_the_emptier_node_first():
    assert plan(nodes(("a", 100, 70), ("b", 100, 10)), 60, {"l1": 10}) == {"b": 60}
    got = plan(nodes(("a", 100, 70), ("b", 100, 10)), 80, {"l1": 10})
    assert sum(got.values()) == 80 and 0 < got["a"] <= 30 and got["b"] > 2 * got["a"]


def test_a_burst_of_several_locks_lands_each_lock_on_one_node_with_locality():
    layers = {k: {f"{k}-top": 100, "base": 10} for k in "ABCD"}
    loads = nodes(("a", 256, 0), ("b", 256, 0))
    plans = plan_groups(loads, [Group(layers[k], 25) for k in "ABCD"])
    assert all(len(p) == 1 for p in plans), plans
    per_node = {n: sum(p.get(n, 0) for p in plans) for n in ("a", "b")}
    assert per_node == {"a": 50, "b": 50}
    randomly = plan_groups(loads, [Group(layers[k], 25) for k in "ABCD"], policy="random",
                           seed=7)
    assert sum(len(p) for p in randomly) > sum(len(p) for p in plans)


def test_a_node_holding_the_layers_is_preferred_within_its_fair_share():
    loads = nodes(("a", 256, 0), ("b", 256, 0), cached={"b": {"l1"}})
    assert plan(loads, 1, {"l1": 10}) == {"b": 1}
    assert plan(loads, 40, {"l1": 10}) == {"a": 20, "b": 20}  # the burst still spreads


def test_warm_sandboxes_are_claimed_first():
    loads = nodes(("a", 10, 0), ("b", 10, 0))
    group = Group({"l1": 1}, 3, warm={"b": 3})
    assert plan_groups(loads, [group]) == [{"b": 3}]


def test_memory_budget_bounds_a_node():
    loads = [NodeLoad("a", 100, 0, memory_bytes=4 << 30, memory_used=0),
             NodeLoad("b", 100, 0, memory_bytes=64 << 30, memory_used=0)]
    got = plan(loads, 10, {"l": 1}, memory=1 << 30)
    assert got["a"] <= 4 and sum(got.values()) == 10


def test_too_many_is_refused_whole():
    with pytest.raises(RuntimeShimError, match="room for 3 more") as e:
        plan(nodes(("a", 2, 0), ("b", 2, 1)), 4, {"l": 1})
    assert e.value.reference == "fleet-full"
    with pytest.raises(RuntimeShimError, match="policy"):
        plan(nodes(("a", 2, 0)), 1, {"l": 1}, policy="nearest")


def test_fleet_ids_name_the_node_and_refuse_anything_else():
    fid = fleet_id("eb-0123456789ab", "ab" * 28)
    assert fid == "eb-0123456789ab@abababababab"
    assert split_fleet_id(fid) == ("eb-0123456789ab", "abababababab")
    for bad in ("eb-0123456789ab", "../x@abababababab", "eb-1@ABABABABABAB", "eb-1@abab"):
        with pytest.raises(SandboxNotFound, match="not a fleet sandbox id"):
            split_fleet_id(bad)


def test_pool_key_ignores_lease_log_and_labels_but_not_limits():
    a = CreateSpec(lock="sha256:" + "0" * 64, limits=Limits(disk_bytes=None))
    b = CreateSpec(lock=a.lock, limits=a.limits, ttl=5, exec_log=True, labels=(("k", "v"),))
    c = CreateSpec(lock=a.lock, limits=Limits())
    assert a.pool_key() == b.pool_key() != c.pool_key()


def test_errors_cross_process_boundaries_with_their_hint():
    e = pickle.loads(pickle.dumps(NodeLost("node x is lost", node_id="x", hint="do y")))
    assert (e.message, e.hint, e.node_id, e.reference) == ("node x is lost", "do y", "x",
                                                          "node-lost")


def test_a_chunk_gives_a_node_its_admission_width_at_a_time():
    loads = nodes(*((f"n{i}", 100, 0) for i in range(160)))
    spread = plan(loads, 100, {"l1": 10})
    assert len(spread) == 100, "one per node: 100 node calls"
    got = plan_groups(loads, [Group({"l1": 10}, 100)], chunk=4)[0]
    assert len(got) == 25 and set(got.values()) == {4}, "25 nodes x 4: 25 node calls"
    assert plan_groups(loads, [Group({"l1": 10}, 6)], chunk=4) == [{"n0": 4, "n1": 2}]
    small = nodes(("a", 3, 0), ("b", 100, 0), cached={"a": {"l1"}, "b": {"l1"}})
    assert plan_groups(small, [Group({"l1": 10}, 6)], chunk=4) == [{"b": 4, "a": 2}]
    assert plan_groups(small, [Group({"l1": 10}, 9)], chunk=4) == [{"b": 6, "a": 3}], \
        "a node's room ends its chunk"
