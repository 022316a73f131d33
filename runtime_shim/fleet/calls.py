"""How the fleet client reaches its node daemons: a ``Calls`` sends one daemon method call and
waits for its answer with a deadline.

``RayCalls`` is the fleet's: Ray actor calls (``handle.method.remote(...)``), waited on by
``cluster.wait_call`` (a daemon that died or missed its deadline gives ``NodeLost``; an error
the daemon raised comes back as itself). ``LocalCalls`` calls in-process ``NodeDaemon``
objects on a thread pool with the same contract, so the real client, placement, admission,
batching and warm pools run without Ray: ``benchmarks/cell_sim.py`` drives 160 of them in one
process, and unit tests use it too. Only the control calls go through a ``Calls``; an exec
streamed chunk by chunk and ``AsyncFleetSandbox`` stay Ray's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Protocol

from envbuild.errors import NodeLost
from runtime_shim.fleet.cluster import ray_api, wait_call


class Calls(Protocol):
    """One transport between a ``Fleet`` and its daemons (module docstring)."""

    def submit(self, handle: Any, method: str, *args: Any) -> Any:
        """Start ``handle.method(*args)`` on its node: a reference ``wait`` takes."""

    def wait(self, ref: Any, timeout: float, node_id: str) -> Any:
        """The call's answer, its error as itself, or ``NodeLost`` past ``timeout``."""

    def node_alive(self, node_id: str) -> bool:
        """Whether the node may still come back (a crashed daemon being restarted)."""

    def kill(self, handle: Any) -> None:
        """Stop a daemon that can never come back."""


class RayCalls:
    """Ray actor calls (module docstring)."""

    def submit(self, handle: Any, method: str, *args: Any) -> Any:
        return getattr(handle, method).remote(*args)

    def wait(self, ref: Any, timeout: float, node_id: str) -> Any:
        return wait_call(ref, timeout, node_id)

    def node_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray_api().nodes())

    def kill(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            ray_api().kill(handle, no_restart=True)


class LocalCalls:
    """In-process daemons (``NodeDaemon`` objects) called on ``workers`` threads: what Ray's
    ``max_concurrency`` threads of each actor do, shared by all the daemons."""

    def __init__(self, workers: int = 512) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="fleet-local-call")

    def submit(self, handle: Any, method: str, *args: Any) -> Any:
        return self._pool.submit(getattr(handle, method), *args)

    def wait(self, ref: Any, timeout: float, node_id: str) -> Any:
        try:
            return ref.result(timeout)
        except concurrent.futures.TimeoutError:
            ref.cancel()
            raise NodeLost(f"node {node_id[:12]} did not answer in {timeout:.0f} s",
                           node_id=node_id,
                           hint="the in-process daemon is overloaded or hung") from None

    def node_alive(self, node_id: str) -> bool:
        return True

    def kill(self, handle: Any) -> None:
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["Calls", "LocalCalls", "RayCalls"]
