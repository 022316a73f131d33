"""The fleet client's view of its nodes' loads between status calls.

Without a view (``status_ttl=0``, the default), every ``Fleet.create`` first asks every daemon
for its status: one call per node per create, 160 on a cell of 160 nodes. With
``status_ttl`` > 0 the client reuses a status answer for that many seconds and counts what it
placed itself since (slots and memory used, the lock's layers a node now holds, the warm
sandboxes it claimed), so a stream of creates from one driver asks each node about once per
TTL. The daemons' own admission stays authoritative: a node fuller than the view says (other
drivers' creates; closes the view does not see make it only more cautious) refuses its batch
whole with ``fleet-full``, and the client then plans once more on fresh statuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from runtime_shim.fleet.model import NodeStatus

#: A status query: the layers and the pool keys it asked about.
Query = tuple[tuple[str, ...], tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Placed:
    """What one plan put on the nodes for one group: ``counts`` per node, each sandbox of
    ``memory`` bytes, of a lock with ``layers``, claiming first from pool ``pool_key``."""

    counts: Mapping[str, int]
    memory: int
    layers: Collection[str]
    pool_key: str


class LoadView:
    """Status answers per query, each kept ``ttl`` seconds (module docstring). Thread-safe:
    several driver threads may create at once."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._views: dict[Query, tuple[float, dict[str, NodeStatus]]] = {}
        self._refreshing: dict[Query, threading.Lock] = {}

    def get(self, query: Query) -> list[NodeStatus] | None:
        """The statuses of ``query`` with this client's placements since counted, or None
        (never asked, older than the TTL, or no view at all)."""
        if self.ttl <= 0:
            return None
        with self._lock:
            hit = self._views.get(query)
            if hit is None or time.monotonic() - hit[0] >= self.ttl:
                return None
            return list(hit[1].values())

    def refreshing(self, query: Query) -> contextlib.AbstractContextManager[Any]:
        """Held while one thread asks the nodes about ``query``, so that the others wait for
        its answer instead of asking every node too (no view: nothing to wait for)."""
        if self.ttl <= 0:
            return contextlib.nullcontext()
        with self._lock:
            return self._refreshing.setdefault(query, threading.Lock())

    def put(self, query: Query, statuses: Sequence[NodeStatus]) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            self._views[query] = (time.monotonic(), {s.node_id: s for s in statuses})

    def placed(self, groups: Sequence[Placed]) -> None:
        """Count a plan's placements into every view held."""
        if self.ttl <= 0:
            return
        with self._lock:
            for (layers, keys), (_, nodes) in self._views.items():
                for g in groups:
                    held = frozenset(layers).intersection(g.layers)
                    for node_id, k in g.counts.items():
                        s = nodes.get(node_id)
                        if s is not None:
                            nodes[node_id] = _after(s, k, g, held,
                                                    g.pool_key in keys)

    def drop(self) -> None:
        with self._lock:
            self._views.clear()


def _after(s: NodeStatus, k: int, g: Placed, held: frozenset[str], pooled: bool
           ) -> NodeStatus:
    """``s`` once ``k`` sandboxes of ``g`` are on the node (warm ones claimed first)."""
    pools = s.pools
    claimed = 0
    if pooled:
        ready = dict(pools).get(g.pool_key, 0)
        claimed = min(ready, k)
        pools = tuple((key, n - claimed if key == g.pool_key else n) for key, n in pools)
    cached = s.cached if held.issubset(s.cached) else tuple(sorted(held.union(s.cached)))
    # a claimed warm sandbox was counted in ``used`` already
    return dataclasses.replace(s, used=s.used + k - claimed, warm=s.warm - claimed,
                               memory_used=s.memory_used + (k - claimed) * max(0, g.memory),
                               cached=cached, pools=pools)


__all__ = ["LoadView", "Placed", "Query"]
