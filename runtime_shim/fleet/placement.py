"""Placement: which node gets how many sandboxes of one ``Fleet.create`` call. Pure.

``plan_groups(nodes, groups)`` places several groups (a lock's layers, a count, the memory of
one sandbox) in one plan, sharing the nodes' free capacity (slots left, and memory left over
the sandbox's ``Limits.memory_bytes``); ``plan`` is the one-group case. Each node has a fair
share of the call, ``total × its free / all free``: spreading the sandboxes over the nodes is
what makes a burst start fast (every node starts its part at once). Within that, each sandbox
goes to the node with the best ``free_fraction + locality_weight × cached_fraction``, where
``cached_fraction`` is the share of the lock's bytes the node already holds, or will hold once
this plan gives it one sandbox of the lock; the locality bonus counts only while the node is
below its fair share. So one big group spreads evenly, and a burst of several locks lands each
lock on few nodes (each node pulls fewer layers from the store) without piling everything on
one. Warm sandboxes (``warm``) are claimed first. ``chunk`` > 1 gives a chosen node up to that
many sandboxes at a time (a node's admission width: a call of 100 on 160 nodes then goes to
25 nodes × 4, each starting its 4 at once, in 25 node calls instead of 100); consecutive plans
still spread, since a node's score counts what it holds. ``policy="random"`` is the baseline
the benchmark compares against: each sandbox on a uniformly random node with room.
"""

from __future__ import annotations

import dataclasses
import heapq
import random as _random
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from envbuild.errors import RuntimeShimError

LOCALITY_WEIGHT = 0.5


class Load(Protocol):
    """What placement reads of a node: ``NodeLoad``, or a daemon's ``NodeStatus`` as is."""

    @property
    def node_id(self) -> str: ...

    @property
    def slots(self) -> int: ...

    @property
    def used(self) -> int: ...

    @property
    def memory_bytes(self) -> int: ...

    @property
    def memory_used(self) -> int: ...

    @property
    def cached(self) -> Collection[str]: ...

    @property
    def warm(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class NodeLoad:
    """What placement needs of a node (from ``NodeStatus``)."""

    node_id: str
    slots: int
    used: int
    memory_bytes: int
    memory_used: int
    cached: frozenset[str] = frozenset()
    warm: int = 0


def free_slots(node: Load, memory: int) -> int:
    free = max(0, node.slots - node.used)
    if memory > 0:
        free = min(free, max(0, node.memory_bytes - node.memory_used) // memory)
    return free


@dataclasses.dataclass(frozen=True)
class Group:
    """One group to place: ``layers`` (digest → size) of its lock, ``n`` sandboxes, each of
    ``memory`` bytes (its memory limit; 0: not counted), ``warm`` ready sandboxes per node
    (node id → count) that it can claim."""

    layers: Mapping[str, int]
    n: int
    memory: int = 0
    warm: Mapping[str, int] = dataclasses.field(default_factory=dict)


def _full(free: int, want: int, nodes: int) -> RuntimeShimError:
    return RuntimeShimError(f"the fleet has room for {free} more sandbox(es), {want} asked "
                            f"({nodes} node(s))", reference="fleet-full",
                            hint="create fewer, close some (`envbuild fleet rm`), or add "
                                 "nodes with the envbuild_node resource")


def plan(nodes: Sequence[Load], n: int, layers: Mapping[str, int], *, memory: int = 0,
         policy: str = "locality", locality_weight: float = LOCALITY_WEIGHT,
         seed: int | None = None) -> dict[str, int]:
    """``{node_id: count}`` summing to ``n`` for one group (``NodeLoad.warm`` its warm
    sandboxes); ``RuntimeShimError`` (``fleet-full``) if the nodes have fewer than ``n`` free
    slots."""
    group = Group(layers=layers, n=n, memory=memory, warm={x.node_id: x.warm for x in nodes})
    return plan_groups(nodes, [group], policy=policy, locality_weight=locality_weight,
                       seed=seed)[0]


def plan_groups(nodes: Sequence[Load], groups: Sequence[Group], *,
                policy: str = "locality", locality_weight: float = LOCALITY_WEIGHT,
                seed: int | None = None, chunk: int = 1) -> list[dict[str, int]]:
    """One ``{node_id: count}`` per group (see the module docstring), all or
    ``RuntimeShimError`` (``fleet-full``)."""
    if policy not in ("locality", "random"):
        raise RuntimeShimError(f"unknown placement policy {policy!r}",
                               hint="use 'locality' or 'random'")
    for g in groups:
        if g.n < 0:
            raise RuntimeShimError(f"cannot create {g.n} sandboxes", hint="pass n >= 1")
    state = _Plan(nodes, sum(g.n for g in groups), locality_weight, seed)
    out: list[dict[str, int]] = []
    for g in groups:
        counts = {i: 0 for i in state.slots}
        left = state.place_warm(g, counts)
        if policy == "random":
            state.place_random(g, counts, left)
        else:
            state.place_best(g, counts, left, max(1, chunk))
        out.append({k: v for k, v in counts.items() if v})
    return out


class _Plan:
    """The nodes' capacity as one ``plan_groups`` call uses it up."""

    def __init__(self, nodes: Sequence[Load], want: int, locality_weight: float,
                 seed: int | None) -> None:
        self.nodes = len(nodes)
        self.want = want
        self.weight = locality_weight
        self.by_id = {x.node_id: x for x in nodes}
        self.slots = {x.node_id: max(0, x.slots - x.used) for x in nodes}
        self.memory = {x.node_id: max(0, x.memory_bytes - x.memory_used) for x in nodes}
        self.total_free = sum(self.slots.values())
        self.fair = {i: want * self.slots[i] / max(1, self.total_free) for i in self.slots}
        self.planned = dict.fromkeys(self.slots, 0)  # sandboxes this plan puts on each node
        self.added: dict[str, set[str]] = {}  # layers a node will hold once given its sandboxes
        self.seed = seed
        self._rng: _random.Random | None = None  # made only for policy="random" (~0.1 ms)

    @property
    def rng(self) -> _random.Random:
        if self._rng is None:
            self._rng = _random.Random(self.seed)
        return self._rng

    def holds(self, node_id: str, digest: str) -> bool:
        """The node has layer ``digest``, or will once this plan gives it a sandbox."""
        return digest in self.by_id[node_id].cached or digest in self.added.get(node_id, ())

    def room(self, node_id: str, g: Group) -> bool:
        return self.slots[node_id] > 0 and (g.memory <= 0 or self.memory[node_id] >= g.memory)

    def put(self, node_id: str, g: Group, counts: dict[str, int]) -> None:
        counts[node_id] += 1
        self.planned[node_id] += 1
        self.slots[node_id] -= 1
        self.memory[node_id] -= max(0, g.memory)
        self.added.setdefault(node_id, set()).update(g.layers)

    def score(self, node_id: str, g: Group) -> float:
        x = self.by_id[node_id]
        s = self.slots[node_id] / max(1, x.slots)
        if g.layers and self.planned[node_id] < self.fair[node_id]:
            size = sum(g.layers.values()) or 1
            s += self.weight * sum(
                b for d, b in g.layers.items() if self.holds(node_id, d)) / size
        return s

    def full(self) -> RuntimeShimError:
        return _full(self.total_free, self.want, self.nodes)

    def place_warm(self, g: Group, counts: dict[str, int]) -> int:
        """A claim from a warm pool first: no start at all. How many are left to place."""
        left = g.n
        for i in self.slots:
            while left and g.warm.get(i, 0) > counts[i] and self.room(i, g):
                self.put(i, g, counts)
                left -= 1
        return left

    def place_random(self, g: Group, counts: dict[str, int], left: int) -> None:
        while left:
            candidates = [i for i in self.slots if self.room(i, g)]
            if not candidates:
                raise self.full()
            self.put(self.rng.choice(candidates), g, counts)
            left -= 1

    def place_best(self, g: Group, counts: dict[str, int], left: int, chunk: int = 1) -> None:
        # a node's score changes only when it is given a sandbox: a heap keeps the
        # plan O(n log nodes) (32,000 sandboxes on 160 nodes in well under a second)
        heap = [(-self.score(i, g), -self.slots[i], i) for i in self.slots if self.room(i, g)]
        heapq.heapify(heap)
        while left:
            if not heap:
                raise self.full()
            _, _, node_id = heapq.heappop(heap)
            for _ in range(min(chunk, left)):
                self.put(node_id, g, counts)
                left -= 1
                if not self.room(node_id, g):
                    break
            if self.room(node_id, g):
                heapq.heappush(heap, (-self.score(node_id, g), -self.slots[node_id], node_id))


__all__ = ["LOCALITY_WEIGHT", "Group", "Load", "NodeLoad", "free_slots", "plan", "plan_groups"]
