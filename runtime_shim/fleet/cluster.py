"""The fleet client's connection to the cluster: joining Ray, starting the node daemons, and
every call to one with a deadline.

The daemons are ``runtime_shim.fleet.daemon``'s ``NodeDaemon`` as Ray actors.

A daemon that died (its node lost, or the actor killed) gives ``NodeLost``, one that does not
answer in time gives ``NodeLost`` too, never a hang; an error the daemon raised
(``SandboxNotFound``, ``LockNotFound``, …) is re-raised as itself (``wait_call``,
``mapped_error``). Ray is imported only when one of these runs (``ray_api``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from envbuild.errors import (
    EnvbuildError,
    FleetUnavailable,
    NodeLost,
    RuntimeShimError,
)
from runtime_shim.fleet.daemon import NodeDaemon
from runtime_shim.fleet.model import NAMESPACE, DaemonConfig, actor_name

#: Seconds a control call (status, list, close, file access) may take before the node counts
#: as lost.
CALL_TIMEOUT = 60.0
#: Extra seconds an exec may take past its own timeout (transport, queueing).
EXEC_MARGIN = 30.0
#: Seconds a create batch may take per sandbox on top of ``CALL_TIMEOUT`` (admission queue).
CREATE_PER_SANDBOX = 2.0
#: The daemon's concurrent calls (threads): execs of different sandboxes run at once.
DAEMON_CONCURRENCY = 256


def ray_api():
    try:
        import ray
    except ImportError as e:
        raise FleetUnavailable("Ray is not installed",
                               hint="install the fleet extra: pip install 'envbuild[fleet]'") \
            from e
    return ray


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast (``FleetUnavailable``) on an address nothing listens at, instead of Ray's
    long retry loop."""
    if address in ("auto", "local", ""):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    host, port = parts.hostname, parts.port
    if not host or not port:
        raise FleetUnavailable(f"bad Ray address {address!r}",
                               hint="use auto, HOST:PORT (the head's GCS) or ray://HOST:PORT")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise FleetUnavailable(f"cannot reach the Ray cluster at {address}: "
                               f"{e.strerror or e}",
                               hint="start it with `ray start --head`, or pass the head's "
                                    "address (ray status prints it)") from None


def store_key(store: str) -> str:
    return store if "://" in store else os.path.abspath(store)


def start_daemons(config: DaemonConfig, *, node_ids: Iterable[str] | None = None,
                  timeout: float = CALL_TIMEOUT,
                  runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Start (or find) the daemon of every live node offering ``envbuild_node`` (or of
    ``node_ids``), each pinned to its node: ``{node_id: actor handle}``. Ray must be
    initialised. ``runtime_env``: Ray's, for the daemons (e.g. ``{"env_vars": {...}}`` with
    the store's credentials). A node whose daemon fails to start raises its error."""
    ray = ray_api()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = list(node_ids) if node_ids is not None else [n["NodeID"] for n in fleet_nodes()]
    actor = ray.remote(NodeDaemon)
    handles = {}
    for node_id in ids:
        handles[node_id] = actor.options(
            name=actor_name(node_id), namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0, resources={"envbuild_node": 1},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            max_restarts=-1, max_task_retries=0, max_concurrency=DAEMON_CONCURRENCY,
            **({"runtime_env": dict(runtime_env)} if runtime_env else {}),
        ).remote(config, node_id)
    for node_id, handle in handles.items():
        hello = wait_call(handle.hello.remote(), timeout, node_id)
        if store_key(hello["store"]) != store_key(config.store):
            raise RuntimeShimError(f"the daemon on node {node_id[:12]} serves store "
                                   f"{hello['store']}, not {config.store}",
                                   hint="stop it (`envbuild fleet stop`) or connect with its "
                                        "store")
    return handles


def wait_unnamed(names: Sequence[str], timeout: float = 30.0) -> None:
    """Wait until Ray has released these actor names (a killed actor keeps its name for a
    moment), so a daemon started next gets a fresh actor, not the dying one."""
    ray = ray_api()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        if not named.intersection(names):
            return
        time.sleep(0.1)


def fleet_nodes() -> list[dict[str, Any]]:
    ray = ray_api()
    return [n for n in ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get("envbuild_node", 0) >= 1]


def wait_call(ref: Any, timeout: float, node_id: str) -> Any:
    """``ray.get`` with a deadline, errors mapped (module docstring)."""
    ray = ray_api()
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - mapped, or re-raised as is
        raise mapped_error(e, node_id, timeout, ref) from None


def mapped_error(e: BaseException, node_id: str, timeout: float, ref: Any = None) -> BaseException:
    """The error a caller sees for what a daemon call raised."""
    from ray.exceptions import (
        ActorUnschedulableError,
        GetTimeoutError,
        RayActorError,
        RayTaskError,
    )

    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, EnvbuildError):
            return cause
        if isinstance(cause, RayActorError):
            return node_lost(node_id, str(cause))
        text = str(cause or e).strip().splitlines()
        return RuntimeShimError(f"the daemon on node {node_id[:12]} failed: "
                                f"{text[-1] if text else type(e).__name__}",
                                hint="its log is in the Ray session dir "
                                     "(/tmp/ray/session_latest/logs)")
    if isinstance(e, (RayActorError, ActorUnschedulableError)):  # the latter: its node is gone
        return node_lost(node_id, type(e).__name__)
    if isinstance(e, (GetTimeoutError, asyncio.TimeoutError)):
        if ref is not None:
            with contextlib.suppress(Exception):
                ray_api().cancel(ref)
        return NodeLost(f"node {node_id[:12]} did not answer in {timeout:.0f} s",
                        node_id=node_id,
                        hint="the node or its daemon is overloaded or hung; "
                             "`envbuild fleet nodes` shows the live ones")
    return e


def node_lost(node_id: str, why: str) -> NodeLost:
    return NodeLost(f"node {node_id[:12]} is lost (its daemon died: {why.splitlines()[0][:200]}); "
                    "its sandboxes are gone with it", node_id=node_id,
                    hint="create new sandboxes; `envbuild fleet nodes` shows the live nodes")


def join_ray(address: str) -> bool:
    """Join the Ray cluster at ``address`` unless this process is in one already: True if it
    joined here (so ``Fleet.disconnect`` leaves it)."""
    ray = ray_api()
    if ray.is_initialized():
        return False
    check_reachable(address)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FleetUnavailable(f"cannot join the Ray cluster at {address}: "
                               f"{str(e).splitlines()[0] if str(e) else e}",
                               hint="start one with `ray start --head`, or pass "
                                    "the head's address") from None
    return True


def kill_orphan_daemons(alive: set[str]) -> None:
    """Kill every daemon actor pinned to a node not in ``alive``: it can never come back."""
    ray = ray_api()
    for a in ray.util.list_named_actors(all_namespaces=True):
        node_of = a["name"][len("envbuild-node-"):]
        if a["name"].startswith("envbuild-node-") and a.get("namespace") == NAMESPACE \
                and node_of not in alive:  # pinned to a node that is gone: never back
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(a["name"], namespace=NAMESPACE), no_restart=True)


def find_daemons(nodes: Sequence[Mapping[str, Any]], timeout: float
                 ) -> tuple[dict[str, Any], list[str]]:
    """``(handles of the live daemons of nodes, ids of the nodes without one)``."""
    ray = ray_api()
    daemons: dict[str, Any] = {}
    missing = []
    for n in nodes:
        try:
            daemons[n["NodeID"]] = ray.get_actor(actor_name(n["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            missing.append(n["NodeID"])
    pings = {nid: h.hello.remote() for nid, h in daemons.items()}
    for nid, ref in pings.items():  # a daemon killed a moment ago may still be named
        try:
            wait_call(ref, timeout, nid)
        except NodeLost:
            daemons.pop(nid)
            wait_unnamed([actor_name(nid)])
            missing.append(nid)
    return daemons, missing


__all__ = ["CALL_TIMEOUT", "CREATE_PER_SANDBOX", "DAEMON_CONCURRENCY", "EXEC_MARGIN",
           "check_reachable", "find_daemons", "fleet_nodes", "join_ray", "kill_orphan_daemons",
           "mapped_error", "node_lost", "ray_api", "start_daemons", "store_key", "wait_call",
           "wait_unnamed"]
