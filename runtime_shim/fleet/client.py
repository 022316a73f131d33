"""The fleet client: ``Fleet.connect`` → ``create`` / ``attach`` / ``list`` / ``close_all`` /
``nodes`` / ``warm`` / ``replay``, and ``FleetSandbox`` handles with the ``Sandbox`` methods.

Every call to a daemon is one Ray actor call waited on with a deadline: a daemon that died
(its node lost, or the actor killed) gives ``NodeLost``, one that does not answer in time
gives ``NodeLost`` too, never a hang; an error the daemon raised (``SandboxNotFound``,
``LockNotFound``, …) is re-raised as itself. ``create(lock, n=...)`` resolves the lock here
(a missing lock fails before any node is asked), asks every daemon for its load and which of
the lock's layers it holds (one call each), plans with ``runtime_shim.fleet.placement`` and
sends one ``create_batch`` per node, all at once; if any node fails, the sandboxes made by the
others are closed and the first error is raised.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from envbuild.errors import (
    EnvbuildError,
    FleetUnavailable,
    NodeLost,
    RuntimeShimError,
    SandboxNotFound,
)
from runtime_shim.fleet import execlog, placement
from runtime_shim.fleet.daemon import (
    NAMESPACE,
    CreateSpec,
    DaemonConfig,
    FirstExec,
    NodeDaemon,
    NodeStatus,
    SandboxRecord,
    actor_name,
    split_fleet_id,
)
from runtime_shim.node.model import ExecResult, Limits, SandboxInfo

#: Seconds a control call (status, list, close, file access) may take before the node counts
#: as lost.
CALL_TIMEOUT = 60.0
#: Extra seconds an exec may take past its own timeout (transport, queueing).
EXEC_MARGIN = 30.0
#: Seconds a create batch may take per sandbox on top of ``CALL_TIMEOUT`` (admission queue).
CREATE_PER_SANDBOX = 2.0
#: The daemon's concurrent calls (threads): execs of different sandboxes run at once.
DAEMON_CONCURRENCY = 256


def _ray():
    try:
        import ray
    except ImportError as e:
        raise FleetUnavailable("Ray is not installed",
                               hint="install the fleet extra: pip install 'envbuild[fleet]'") \
            from e
    return ray


def _check_reachable(address: str, timeout: float = 5.0) -> None:
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


def _store_key(store: str) -> str:
    return store if "://" in store else os.path.abspath(store)


def start_daemons(config: DaemonConfig, *, node_ids: Iterable[str] | None = None,
                  timeout: float = CALL_TIMEOUT,
                  runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Start (or find) the daemon of every live node offering ``envbuild_node`` (or of
    ``node_ids``), each pinned to its node: ``{node_id: actor handle}``. Ray must be
    initialised. ``runtime_env``: Ray's, for the daemons (e.g. ``{"env_vars": {...}}`` with
    the store's credentials). A node whose daemon fails to start raises its error."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = list(node_ids) if node_ids is not None else [n["NodeID"] for n in _fleet_nodes()]
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
        hello = _get(handle.hello.remote(), timeout, node_id)
        if _store_key(hello["store"]) != _store_key(config.store):
            raise RuntimeShimError(f"the daemon on node {node_id[:12]} serves store "
                                   f"{hello['store']}, not {config.store}",
                                   hint="stop it (`envbuild fleet stop`) or connect with its "
                                        "store")
    return handles


def _wait_unnamed(names: Sequence[str], timeout: float = 30.0) -> None:
    """Wait until Ray has released these actor names (a killed actor keeps its name for a
    moment), so a daemon started next gets a fresh actor, not the dying one."""
    ray = _ray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        if not named.intersection(names):
            return
        time.sleep(0.1)


def _fleet_nodes() -> list[dict[str, Any]]:
    ray = _ray()
    return [n for n in ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get("envbuild_node", 0) >= 1]


def _get(ref: Any, timeout: float, node_id: str) -> Any:
    """``ray.get`` with a deadline, errors mapped (module docstring)."""
    ray = _ray()
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - mapped, or re-raised as is
        raise _mapped(e, node_id, timeout, ref) from None


def _mapped(e: BaseException, node_id: str, timeout: float, ref: Any = None) -> BaseException:
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
            return _lost(node_id, str(cause))
        text = str(cause or e).strip().splitlines()
        return RuntimeShimError(f"the daemon on node {node_id[:12]} failed: "
                                f"{text[-1] if text else type(e).__name__}",
                                hint="its log is in the Ray session dir "
                                     "(/tmp/ray/session_latest/logs)")
    if isinstance(e, (RayActorError, ActorUnschedulableError)):  # the latter: its node is gone
        return _lost(node_id, type(e).__name__)
    if isinstance(e, (GetTimeoutError, asyncio.TimeoutError)):
        if ref is not None:
            with contextlib.suppress(Exception):
                _ray().cancel(ref)
        return NodeLost(f"node {node_id[:12]} did not answer in {timeout:.0f} s",
                        node_id=node_id,
                        hint="the node or its daemon is overloaded or hung; "
                             "`envbuild fleet nodes` shows the live ones")
    return e


def _lost(node_id: str, why: str) -> NodeLost:
    return NodeLost(f"node {node_id[:12]} is lost (its daemon died: {why.splitlines()[0][:200]}); "
                    "its sandboxes are gone with it", node_id=node_id,
                    hint="create new sandboxes; `envbuild fleet nodes` shows the live nodes")


class Fleet:
    """Sandboxes across a Ray cluster's ``envbuild_node`` nodes (module docstring)."""

    def __init__(self, store_url: str, store: Any, daemons: dict[str, Any], *,
                 owns_ray: bool, config: DaemonConfig | None) -> None:
        self.store_url = store_url
        self.store = store
        self._daemons = daemons
        self._owns_ray = owns_ray
        self._config = config
        self._warmed: set[str] = set()  # pool keys this client warmed: claim first
        self._claim_turn = 0

    @classmethod
    def connect(cls, address: str = "auto", store: str | None = None, *,
                s3_endpoint: str | None = None, node_dir: str | None = None,
                start: bool = True, slots: int = 256, memory_bytes: int | None = None,
                max_starting: int = 4, runtime: str = "runc",
                runtime_env: Mapping[str, Any] | None = None,
                timeout: float = CALL_TIMEOUT) -> Fleet:
        """Join the Ray cluster at ``address`` (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``)
        and find its node daemons; with ``start`` (default) start the missing ones with
        ``store`` and ``node_dir`` (a template with ``{node_id}``; default
        ``/var/lib/envbuild/fleet/{node_id}``) and the capacity arguments (``DaemonConfig``).
        ``store``: an ``s3://`` URL or a directory every node reads (default
        ``$ENVBUILD_STORE``); ``runtime_env``: Ray's, for the daemons started. Errors:
        ``FleetUnavailable`` (no cluster there, no node offers ``envbuild_node``),
        ``StoreUnavailable``."""
        from runtime_shim.fleet.daemon import _open_url
        from runtime_shim.sdk.sandbox import open_store

        ray = _ray()
        store = store or os.environ.get("ENVBUILD_STORE")
        if not store:
            raise RuntimeShimError("a fleet needs a store every node can read",
                                   hint="pass store='s3://BUCKET/PREFIX' (or a directory on "
                                        "a one-host cluster), or set $ENVBUILD_STORE")
        s3_endpoint = s3_endpoint or os.environ.get("ENVBUILD_S3_ENDPOINT")
        if "://" not in store:
            store = os.path.abspath(store)
        opened = open_store(_open_url(store, s3_endpoint))
        owns = False
        if not ray.is_initialized():
            _check_reachable(address)
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                         logging_level="ERROR", configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise FleetUnavailable(f"cannot join the Ray cluster at {address}: "
                                       f"{str(e).splitlines()[0] if str(e) else e}",
                                       hint="start one with `ray start --head`, or pass "
                                            "the head's address") from None
            owns = True
        config = DaemonConfig(store=store, node_dir=node_dir or
                              "/var/lib/envbuild/fleet/{node_id}", s3_endpoint=s3_endpoint,
                              slots=slots, memory_bytes=memory_bytes,
                              max_starting=max_starting, runtime=runtime)
        nodes = _fleet_nodes()
        if not nodes:
            raise FleetUnavailable(f"no node of the Ray cluster at {address} offers the "
                                   "envbuild_node resource",
                                   hint="start nodes with `ray start --address HEAD "
                                        "--resources '{\"envbuild_node\": 1}'`")
        alive = {n["NodeID"] for n in nodes}
        for a in ray.util.list_named_actors(all_namespaces=True):
            node_of = a["name"][len("envbuild-node-"):]
            if a["name"].startswith("envbuild-node-") and a.get("namespace") == NAMESPACE \
                    and node_of not in alive:  # pinned to a node that is gone: never back
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(a["name"], namespace=NAMESPACE), no_restart=True)
        daemons: dict[str, Any] = {}
        missing = []
        for n in nodes:
            try:
                daemons[n["NodeID"]] = ray.get_actor(actor_name(n["NodeID"]),
                                                     namespace=NAMESPACE)
            except ValueError:
                missing.append(n["NodeID"])
        pings = {nid: h.hello.remote() for nid, h in daemons.items()}
        for nid, ref in pings.items():  # a daemon killed a moment ago may still be named
            try:
                _get(ref, timeout, nid)
            except NodeLost:
                daemons.pop(nid)
                _wait_unnamed([actor_name(nid)])
                missing.append(nid)
        if missing and start:
            daemons.update(start_daemons(config, node_ids=missing, timeout=timeout,
                                         runtime_env=runtime_env))
        if not daemons:
            raise FleetUnavailable("no fleet daemon runs on the cluster",
                                   hint="start them with `envbuild fleet start` (or "
                                        "Fleet.connect(start=True))")
        return cls(store, opened, daemons, owns_ray=owns, config=config)

    # -- nodes ------------------------------------------------------------------------------

    def _daemon(self, node_id: str) -> Any:
        handle = self._daemons.get(node_id)
        if handle is None:
            raise _lost(node_id, "no daemon known for it")
        return handle

    def call(self, node_id: str, method: str, *args: Any,
             timeout: float = CALL_TIMEOUT) -> Any:
        """One daemon method, waited on with ``timeout`` (errors as the module says)."""
        handle = self._daemon(node_id)
        try:
            return _get(getattr(handle, method).remote(*args), timeout, node_id)
        except NodeLost:
            self._forget_if_dead(node_id)
            raise

    def _forget_if_dead(self, node_id: str) -> None:
        """A daemon whose Ray node is dead can never come back (it is pinned to that node):
        kill its actor, so no restarting actor is left waiting for the node forever."""
        ray = _ray()
        if any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
            return  # a crashed daemon Ray is restarting: it re-adopts its sandboxes
        handle = self._daemons.pop(node_id, None)
        if handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    def _all(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT,
             skip_lost: bool = False) -> dict[str, Any]:
        refs = {nid: getattr(h, method).remote(*args) for nid, h in self._daemons.items()}
        out = {}
        for nid, ref in refs.items():
            try:
                out[nid] = _get(ref, timeout, nid)
            except NodeLost:
                self._forget_if_dead(nid)
                if not skip_lost:
                    raise
        return out

    def nodes(self, layers: Sequence[str] = (), pool_keys: Sequence[str] = ()
              ) -> list[NodeStatus]:
        """Every live node's capacity and load (lost ones are left out); ``cached``: which
        of ``layers`` each holds; ``pools``: its ready sandboxes of ``pool_keys``."""
        found = self._all("status", tuple(layers), tuple(pool_keys), skip_lost=True)
        return [found[k] for k in sorted(found)]

    @property
    def node_ids(self) -> list[str]:
        return sorted(self._daemons)

    # -- sandboxes --------------------------------------------------------------------------

    def _spec(self, lock: str, *, backend: str, lazy: bool, network: bool | Sequence[str],
              limits: Limits | None, ttl: float | None, exec_log: bool,
              labels: Mapping[str, str] | None, seccomp: str | None):
        from envbuild.errors import LockNotFound
        from runtime_shim.node.locks import resolve

        try:
            resolved = resolve(self.store, lock)
        except LockNotFound as e:
            raise LockNotFound(f"{e.message} (in the fleet's store {self.store_url})",
                               hint=e.hint) from None
        if ttl is not None and not ttl > 0:
            raise RuntimeShimError(f"ttl must be a positive number of seconds, not {ttl!r}")
        spec = CreateSpec(lock=resolved.digest, backend=backend, lazy=lazy,
                          network=network if isinstance(network, bool) else tuple(network),
                          limits=limits, seccomp=seccomp, ttl=ttl, exec_log=exec_log,
                          labels=tuple(sorted((labels or {}).items())))
        return spec, resolved

    def create(self, lock: str, *, n: int = 1, backend: str = "container", lazy: bool = False,
               network: bool | Sequence[str] = False, limits: Limits | None = None,
               ttl: float | None = None, exec_log: bool = False,
               labels: Mapping[str, str] | None = None, seccomp: str | None = None,
               placement_policy: str = "locality",
               first_exec: str | Sequence[str] | None = None) -> list[FleetSandbox]:
        """Start ``n`` sandboxes of ``lock`` (ref or digest) across the fleet; the arguments
        are ``Sandbox.create``'s, ``ttl`` the lease (see ``runtime_shim.fleet.daemon``). All
        ``n`` or none. ``first_exec``: a command each sandbox runs on its node as soon as it
        is ready, within the same call (no extra round trip: a warm claim and its first
        command are one Ray call); its ``ExecResult`` is the handle's ``first_result``."""
        spec, resolved = self._spec(lock, backend=backend, lazy=lazy, network=network,
                                    limits=limits, ttl=ttl, exec_log=exec_log, labels=labels,
                                    seccomp=seccomp)
        first: FirstExec | None = None if first_exec is None else (
            first_exec if isinstance(first_exec, str) else list(first_exec), {})
        claimed = self._claim(spec, n, first) if spec.pool_key() in self._warmed else []
        if len(claimed) == n:
            return claimed
        try:
            return claimed + self._create_specs([(spec, resolved, n - len(claimed))],
                                                placement_policy, first)[0]
        except BaseException:
            for h in claimed:
                with contextlib.suppress(EnvbuildError):
                    h.close()
            raise

    def _claim(self, spec: CreateSpec, n: int, first: FirstExec | None = None
               ) -> builtins.list[FleetSandbox]:
        """The fast path of a warmed spec: ask the nodes in turn for ready sandboxes (one
        call each, starting after the node asked last), until ``n`` or every node said no."""
        got: builtins.list[FleetSandbox] = []
        ids = sorted(self._daemons)
        start = self._claim_turn % max(1, len(ids))
        for nid in ids[start:] + ids[:start]:
            if len(got) == n:
                break
            self._claim_turn += 1
            try:
                got.extend(_handles(self, self.call(nid, "claim", spec, n - len(got), first),
                                    first))
            except NodeLost:
                continue
        return got

    def create_many(self, requests: Sequence[tuple[str, int] | tuple[str, int, Mapping]], *,
                    placement_policy: str = "locality", **kwargs: Any
                    ) -> list[list[FleetSandbox]]:
        """Several ``(lock, n)`` groups placed in one plan (``placement.plan_groups``: each
        lock on few nodes, the load spread), the other arguments ``create``'s for all (a
        third item, a mapping, overrides them for its group); one handle list per group.
        All or none."""
        specs = []
        for req in requests:
            lock, n = req[0], req[1]
            options = req[2] if len(req) > 2 else {}  # type: ignore[misc]
            spec, resolved = self._spec(lock, **{
                "backend": "container", "lazy": False, "network": False, "limits": None,
                "ttl": None, "exec_log": False, "labels": None, "seccomp": None, **kwargs,
                **options})
            specs.append((spec, resolved, n))
        return self._create_specs(specs, placement_policy)

    def _create_specs(self, specs: Sequence[tuple[CreateSpec, Any, int]], policy: str,
                      first: FirstExec | None = None) -> list[list[FleetSandbox]]:
        layers = sorted({x.digest for _, r, _ in specs for x in r.layers})
        keys = [spec.pool_key() for spec, _, _ in specs]
        status = self.nodes(layers, keys)
        if not status:
            raise FleetUnavailable("every node of the fleet is lost",
                                   hint="`envbuild fleet nodes`; add nodes with envbuild_node")
        loads = [placement.NodeLoad(node_id=s.node_id, slots=s.slots, used=s.used,
                                    memory_bytes=s.memory_bytes, memory_used=s.memory_used,
                                    cached=frozenset(s.cached)) for s in status]
        groups = [placement.Group(layers={x.digest: x.size for x in r.layers}, n=n,
                                  memory=(spec.limits or Limits()).memory_bytes or 0,
                                  warm={s.node_id: dict(s.pools).get(key, 0) for s in status})
                  for (spec, r, n), key in zip(specs, keys, strict=True)]
        plans = placement.plan_groups(loads, groups, policy=policy)
        return self._create_batches([(spec, counts) for (spec, _, _), counts
                                     in zip(specs, plans, strict=True)], first)

    def _create_batches(self, batches: Sequence[tuple[CreateSpec, Mapping[str, int]]],
                        first: FirstExec | None = None) -> list[list[FleetSandbox]]:
        refs = [[(nid, k, self._daemon(nid).create_batch.remote(spec, k, first))
                 for nid, k in counts.items()] for spec, counts in batches]
        made: list[list[Any]] = []
        errors: list[BaseException] = []
        for group in refs:
            records: list[Any] = []
            for nid, k, ref in group:
                try:
                    records.extend(_get(ref, CALL_TIMEOUT + CREATE_PER_SANDBOX * k, nid))
                except Exception as e:  # noqa: BLE001 - the others are closed, then raised
                    errors.append(e)
            made.append(records)
        if errors:
            for record in (r[0] if first else r for rs in made for r in rs):
                with contextlib.suppress(EnvbuildError):
                    self.call(record.node_id, "close", split_fleet_id(record.id)[0])
            raise errors[0]
        return [_handles(self, rs, first) for rs in made]

    def create_groups(self, groups: Sequence[Any], **kwargs: Any
                      ) -> list[list[FleetSandbox]]:
        """Every group of a resolved job manifest (``envbuild.jobs`` ``SandboxGroup``s) in
        one plan: one handle list per group, all or none. Each group's lock is checked to
        still close over its pinned layers first."""
        from runtime_shim.node.locks import resolve

        requests = []
        for g in groups:
            g.require_resolved()
            g.check_lock(resolve(self.store, g.lock))
            requests.append((g.lock, g.count, {**g.sandbox_options(), **kwargs}))
        return self.create_many(requests)

    def attach(self, sandbox_id: str, *, ttl: float | None = None) -> FleetSandbox:
        """The handle of a live fleet sandbox (made by any driver); renews its lease.
        ``SandboxNotFound`` (no such sandbox, or an id of another cluster) or ``NodeLost``."""
        sdk_id, prefix = split_fleet_id(sandbox_id)
        node_id = self._node_for(prefix, sandbox_id)
        return FleetSandbox(self, self.call(node_id, "attach", sdk_id, ttl))

    def _node_for(self, prefix: str, sandbox_id: str) -> str:
        for nid in self._daemons:
            if nid.startswith(prefix):
                return nid
        ray = _ray()
        for n in ray.nodes():
            if n["NodeID"].startswith(prefix):
                raise NodeLost(f"sandbox {sandbox_id} was on node {prefix}, which is lost",
                               node_id=n["NodeID"],
                               hint="its sandboxes are gone with it; create new ones")
        raise SandboxNotFound(f"sandbox {sandbox_id} is not of this cluster (no node {prefix})",
                              hint="check the address you connected to; `envbuild fleet ls` "
                                   "lists this cluster's sandboxes")

    def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[SandboxRecord]:
        """Every live sandbox of the fleet (sorted by id); lost nodes are left out."""
        want = tuple(sorted((labels or {}).items()))
        found = self._all("list_sandboxes", want, skip_lost=True)
        return sorted((r for rs in found.values() for r in rs), key=lambda r: r.id)

    def close_all(self, *, lock: str | None = None,
                  labels: Mapping[str, str] | None = None) -> builtins.list[str]:
        """Close every sandbox of the fleet, or those of ``lock`` / with ``labels``: their
        fleet ids."""
        from runtime_shim.fleet.daemon import fleet_id

        digest = self._spec(lock, backend="container", lazy=False, network=False, limits=None,
                            ttl=None, exec_log=False, labels=None, seccomp=None)[0].lock \
            if lock else None
        want = tuple(sorted((labels or {}).items()))
        found = self._all("close_all", digest, want, skip_lost=True)
        return sorted(fleet_id(sid, nid) for nid, ids in found.items() for sid in ids)

    def gc(self) -> builtins.list[str]:
        """Every node's expired and unowned sandboxes removed: their fleet ids."""
        from runtime_shim.fleet.daemon import fleet_id

        found = self._all("gc", skip_lost=True)
        return sorted(fleet_id(sid, nid) for nid, ids in found.items() for sid in ids)

    def warm(self, lock: str, *, per_node: int, wait: float | None = None,
             backend: str = "container", lazy: bool = False,
             network: bool | Sequence[str] = False, limits: Limits | None = None,
             seccomp: str | None = None) -> str:
        """Keep ``per_node`` ready sandboxes of ``lock`` on every node (0: stop), so a
        ``create`` with the same arguments claims instead of starting; refilled in the
        background. ``wait``: seconds to wait until every pool is full (``NodeLost`` past
        it). The pool key."""
        spec, _ = self._spec(lock, backend=backend, lazy=lazy, network=network, limits=limits,
                             ttl=None, exec_log=False, labels=None, seccomp=seccomp)
        keys = self._all("warm", spec, per_node)
        key = next(iter(keys.values()))
        if per_node > 0:
            self._warmed.add(key)
        else:
            self._warmed.discard(key)
        if wait:
            deadline = time.monotonic() + wait
            while True:
                counts = self._all("warm_count", key)
                if all(c >= per_node for c in counts.values()):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeShimError(f"warm pools not full after {wait:.0f} s: {counts}",
                                           hint="the nodes may lack room (slots, memory)")
                time.sleep(0.05)
        return key

    def replay(self, log_id: str, *, into: FleetSandbox, upto: int | None = None
               ) -> execlog.ReplayReport:
        """Re-create a sandbox's state in ``into`` by re-running its exec log's commands (and
        file writes) in order, on ``into``'s node (the log is read from the store there)."""
        execlog.read(self.store, log_id)  # a missing log fails here, with its hint
        return self.call(into.node_id, "replay", log_id, into.sdk_id, upto,
                         timeout=CALL_TIMEOUT * 10)

    def fast_forward(self, log_id: str, *, into: FleetSandbox) -> FastForward:
        """``FastForward``: a restarted rollout's commands answered from the log while they
        match it (see ``runtime_shim.fleet.execlog``)."""
        return FastForward(self, execlog.read(self.store, log_id), into)

    # -- teardown ---------------------------------------------------------------------------

    def stop_daemons(self, *, remove: bool = True) -> builtins.list[str]:
        """Close every sandbox (with ``remove``) and kill every daemon actor: the fleet ids
        closed. For operators and tests; a later ``connect`` starts new daemons."""
        from runtime_shim.fleet.daemon import fleet_id

        ray = _ray()
        closed = self._all("shutdown", remove, skip_lost=True)
        for handle in self._daemons.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        _wait_unnamed([actor_name(nid) for nid in self._daemons])
        self._daemons = {}
        return sorted(fleet_id(s, nid) for nid, ids in closed.items() for s in ids)

    def disconnect(self) -> None:
        """Leave the cluster (if ``connect`` joined it); sandboxes stay with their daemons."""
        if self._owns_ray:
            _ray().shutdown()
            self._owns_ray = False

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()


def _handles(fleet: Fleet, answers: Sequence[Any], first: FirstExec | None
             ) -> builtins.list[FleetSandbox]:
    """Handles of a daemon's create/claim answer: records, or ``(record, result)`` pairs
    when a first exec was asked for."""
    if first is None:
        return [FleetSandbox(fleet, r) for r in answers]
    return [FleetSandbox(fleet, r, first_result=res) for r, res in answers]


class FleetSandbox:
    """One fleet sandbox: ``Sandbox``'s methods, each one call to its node's daemon.
    ``first_result``: the ``ExecResult`` of ``create(..., first_exec=...)`` (else None)."""

    def __init__(self, fleet: Fleet, record: SandboxRecord, *,
                 first_result: ExecResult | None = None) -> None:
        self.fleet = fleet
        self.record = record
        self.first_result = first_result
        self.id = record.id
        self.node_id = record.node_id
        self.sdk_id = split_fleet_id(record.id)[0]
        self.lock = record.lock
        self.backend = record.backend
        self.exec_log = record.exec_log

    def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        return self.fleet.call(self.node_id, method, self.sdk_id, *args, timeout=timeout)

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | None = None,
             on_stdout: Callable[[bytes], None] | None = None,
             on_stderr: Callable[[bytes], None] | None = None,
             check_timeout: bool = False) -> ExecResult:
        """``Sandbox.exec`` in the fleet; with ``on_stdout``/``on_stderr`` the output is
        streamed from the node as it arrives (the callbacks run in this thread)."""
        kwargs = _exec_kwargs(timeout, env, cwd, user, stdin, check_timeout)
        deadline = (timeout or Limits().exec_timeout) + EXEC_MARGIN
        if on_stdout is None and on_stderr is None:
            return self._call("exec", cmd, kwargs, timeout=deadline)
        gen = self.fleet._daemon(self.node_id).exec_stream.remote(self.sdk_id, cmd, kwargs)
        end = time.monotonic() + deadline
        while True:
            left = end - time.monotonic()
            try:
                # Ray's generator with a deadline (a nil ref when nothing came in time)
                ref = gen._next_sync(timeout_s=max(0.001, left))
            except StopIteration:
                raise RuntimeShimError(f"exec stream of {self.id} ended without a result") \
                    from None
            except Exception as e:  # noqa: BLE001 - the actor died between chunks
                _get_error(e, self.node_id)
            if ref.is_nil():
                with contextlib.suppress(Exception):
                    _ray().cancel(gen)
                raise NodeLost(f"node {self.node_id[:12]} sent nothing of the exec in "
                               f"{deadline:.0f} s", node_id=self.node_id,
                               hint="the node or its daemon is overloaded or hung; "
                                    "`envbuild fleet nodes` shows the live ones")
            kind, value = _get(ref, max(1.0, end - time.monotonic()), self.node_id)
            if kind == "stdout" and on_stdout:
                on_stdout(value)
            elif kind == "stderr" and on_stderr:
                on_stderr(value)
            elif kind == "result":
                return value
            elif kind == "error":
                raise value

    def read_file(self, path: str) -> bytes:
        return self._call("read_file", path)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._call("write_file", path, data.encode() if isinstance(data, str) else data, mode)

    def set_network(self, network: bool | Sequence[str]) -> None:
        """``Sandbox.set_network`` on the node."""
        self._call("set_network", network if isinstance(network, bool) else list(network))

    def pack_diff(self, publish: str | None = None, **kwargs: Any):
        """``Sandbox.pack_diff`` on the node (a ``SnapshotResult``)."""
        return self._call("pack_diff", publish, kwargs, timeout=CALL_TIMEOUT * 10)

    def info(self) -> SandboxInfo:
        return self._call("info")[0]

    def renew(self, ttl: float | None = None) -> SandboxRecord:
        """Extend the lease by ``ttl`` (default: the one it was created with)."""
        self.record = self._call("renew", ttl)
        return self.record

    def close(self) -> None:
        """Stop and remove the sandbox; idempotent."""
        with contextlib.suppress(SandboxNotFound):
            self._call("close")

    def aio(self) -> AsyncFleetSandbox:
        return AsyncFleetSandbox(self)

    def __enter__(self) -> FleetSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FleetSandbox {self.id} lock={self.lock[:19]}>"


async def _awaited(ref: Any) -> Any:
    return await ref


def _get_error(e: BaseException, node_id: str) -> None:
    raise _mapped(e, node_id, 0.0) from None


def _exec_kwargs(timeout, env, cwd, user, stdin, check_timeout) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for k, v in (("timeout", timeout), ("env", env), ("cwd", cwd), ("user", user),
                 ("stdin", stdin)):
        if v is not None:
            kwargs[k] = dict(v) if k == "env" else v
    if check_timeout:
        kwargs["check_timeout"] = True
    return kwargs


class AsyncFleetSandbox:
    """A ``FleetSandbox`` whose methods are coroutines (Ray object refs awaited on the event
    loop, each with the same deadline as the blocking form)."""

    def __init__(self, sandbox: FleetSandbox) -> None:
        self.sync = sandbox

    @property
    def id(self) -> str:
        return self.sync.id

    async def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        sb = self.sync
        ref = getattr(sb.fleet._daemon(sb.node_id), method).remote(sb.sdk_id, *args)
        try:
            return await asyncio.wait_for(_awaited(ref), timeout)
        except Exception as e:  # noqa: BLE001 - mapped, or re-raised as is
            raise _mapped(e, sb.node_id, timeout, ref) from None

    async def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | None = None,
                   on_stdout: Callable[[bytes], None] | None = None,
                   on_stderr: Callable[[bytes], None] | None = None,
                   check_timeout: bool = False) -> ExecResult:
        if on_stdout or on_stderr:  # streaming: the blocking form in a thread
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.sync.exec(cmd, timeout=timeout, env=env, cwd=cwd,
                                             user=user, stdin=stdin, on_stdout=on_stdout,
                                             on_stderr=on_stderr, check_timeout=check_timeout))
        kwargs = _exec_kwargs(timeout, env, cwd, user, stdin, check_timeout)
        return await self._call("exec", cmd, kwargs,
                                timeout=(timeout or Limits().exec_timeout) + EXEC_MARGIN)

    async def read_file(self, path: str) -> bytes:
        return await self._call("read_file", path)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._call("write_file", path, data.encode() if isinstance(data, str) else data,
                         mode)

    async def set_network(self, network: bool | Sequence[str]) -> None:
        await self._call("set_network",
                         network if isinstance(network, bool) else list(network))

    async def pack_diff(self, publish: str | None = None, **kwargs: Any):
        return await self._call("pack_diff", publish, kwargs, timeout=CALL_TIMEOUT * 10)

    async def info(self) -> SandboxInfo:
        return (await self._call("info"))[0]

    async def close(self) -> None:
        with contextlib.suppress(SandboxNotFound):
            await self._call("close")

    async def __aenter__(self) -> AsyncFleetSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class FastForward:
    """A restarted rollout's view of a sandbox: ``exec``/``write_file`` that match the exec
    log's next entry return the recorded result without running; at the first one that does
    not (or ``sync()``), the matched prefix is replayed into the sandbox so it is in that
    state, and from then on everything runs for real. ``matched``: entries answered from the
    log."""

    def __init__(self, fleet: Fleet, log: execlog.ExecLog, into: FleetSandbox) -> None:
        self.fleet = fleet
        self.log = log
        self.into = into
        self.matched = 0
        self._live = False

    def _next(self) -> execlog.LogEntry | None:
        if self._live or self.matched >= len(self.log.entries):
            return None
        return self.log.entries[self.matched]

    def sync(self) -> None:
        """Bring the sandbox to the matched state and stop answering from the log."""
        if not self._live:
            self._live = True
            if self.matched:
                self.fleet.replay(self.log.log_id, into=self.into, upto=self.matched)

    def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> ExecResult:
        entry = self._next()
        plain = {k: v for k, v in kwargs.items() if k not in ("on_stdout", "on_stderr")}
        if entry is not None and entry.result is not None and entry.matches_exec(cmd, plain):
            self.matched += 1
            return entry.result
        self.sync()
        return self.into.exec(cmd, **kwargs)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        entry = self._next()
        if entry is not None and entry.matches_write(path, raw, mode):
            self.matched += 1
            return
        self.sync()
        self.into.write_file(path, raw, mode)

    def read_file(self, path: str) -> bytes:
        self.sync()
        return self.into.read_file(path)


__all__ = ["AsyncFleetSandbox", "FastForward", "Fleet", "FleetSandbox", "start_daemons"]
