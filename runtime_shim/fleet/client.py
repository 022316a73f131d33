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

This module is ``Fleet``; the cluster connection (joining Ray, starting the daemons, each call
with its deadline and error mapping) is ``runtime_shim.fleet.cluster``, the sandbox handles
``runtime_shim.fleet.handle``.
"""


from __future__ import annotations

import builtins
import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from envbuild.errors import (
    EnvbuildError,
    FleetUnavailable,
    NodeLost,
    RuntimeShimError,
    SandboxNotFound,
)
from runtime_shim.fleet import execlog, placement
from runtime_shim.fleet.calls import Calls, RayCalls
from runtime_shim.fleet.cluster import (
    CALL_TIMEOUT,
    CREATE_PER_SANDBOX,
    DAEMON_CONCURRENCY,
    EXEC_MARGIN,
    find_daemons,
    fleet_nodes,
    join_ray,
    kill_orphan_daemons,
    node_lost,
    ray_api,
    start_daemons,
    wait_unnamed,
)
from runtime_shim.fleet.handle import AsyncFleetSandbox, FastForward, FleetSandbox, handles
from runtime_shim.fleet.model import (
    CreateSpec,
    DaemonConfig,
    FirstExec,
    NodeStatus,
    SandboxRecord,
    actor_name,
    fleet_id,
    open_url,
    split_fleet_id,
)
from runtime_shim.fleet.view import LoadView, Placed
from runtime_shim.node.model import Limits


class Fleet:
    """Sandboxes across a Ray cluster's ``envbuild_node`` nodes (module docstring)."""

    def __init__(self, store_url: str, store: Any, daemons: dict[str, Any], *,
                 owns_ray: bool, config: DaemonConfig | None, calls: Calls | None = None,
                 status_ttl: float = 0.0, node_batch: int = 1) -> None:
        """``calls``: how daemons are reached (``runtime_shim.fleet.calls``; default Ray's);
        ``status_ttl``: seconds a node status answer is reused for placement
        (``runtime_shim.fleet.view``; 0: every create asks every node); ``node_batch``:
        sandboxes placement gives a node at a time (``placement.plan_groups``' ``chunk``;
        the nodes' ``max_starting`` makes small calls cost fewer node calls)."""
        self.store_url = store_url
        self.store = store
        self._daemons = daemons
        self._owns_ray = owns_ray
        self._config = config
        self._calls: Calls = calls or RayCalls()
        self._view = LoadView(status_ttl)
        self._node_batch = node_batch
        self._locks: dict[str, Any] = {}  # lock digest -> ResolvedLock
        self._warmed: set[str] = set()  # pool keys this client warmed: claim first
        self._claim_turn = 0

    @classmethod
    def connect(cls, address: str = "auto", store: str | None = None, *,
                s3_endpoint: str | None = None, node_dir: str | None = None,
                start: bool = True, slots: int = 256, memory_bytes: int | None = None,
                max_starting: int = 4, runtime: str = "runc",
                runtime_env: Mapping[str, Any] | None = None,
                timeout: float = CALL_TIMEOUT, status_ttl: float = 0.0,
                workers: int = 0, node_batch: int = 1,
                data_host: str | None = None) -> Fleet:
        """Join the Ray cluster at ``address`` (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``)
        and find its node daemons; with ``start`` (default) start the missing ones with
        ``store`` and ``node_dir`` (a template with ``{node_id}``; default
        ``/var/lib/envbuild/fleet/{node_id}``) and the capacity arguments (``DaemonConfig``).
        ``store``: an ``s3://`` URL or a directory every node reads (default
        ``$ENVBUILD_STORE``); ``runtime_env``: Ray's, for the daemons started;
        ``status_ttl``, ``node_batch``: as ``Fleet``; ``workers``, ``data_host``: as
        ``DaemonConfig``. Errors:
        ``FleetUnavailable`` (no cluster there, no node offers ``envbuild_node``),
        ``StoreUnavailable``."""
        from runtime_shim.sdk.sandbox import open_store

        ray_api()  # FleetUnavailable before anything else when Ray is not installed
        store = store or os.environ.get("ENVBUILD_STORE")
        if not store:
            raise RuntimeShimError("a fleet needs a store every node can read",
                                   hint="pass store='s3://BUCKET/PREFIX' (or a directory on "
                                        "a one-host cluster), or set $ENVBUILD_STORE")
        s3_endpoint = s3_endpoint or os.environ.get("ENVBUILD_S3_ENDPOINT")
        if "://" not in store:
            store = os.path.abspath(store)
        opened = open_store(open_url(store, s3_endpoint))
        owns = join_ray(address)
        config = DaemonConfig(store=store, node_dir=node_dir or
                              "/var/lib/envbuild/fleet/{node_id}", s3_endpoint=s3_endpoint,
                              slots=slots, memory_bytes=memory_bytes,
                              max_starting=max_starting, runtime=runtime, workers=workers,
                              data_host=data_host)
        nodes = fleet_nodes()
        if not nodes:
            raise FleetUnavailable(f"no node of the Ray cluster at {address} offers the "
                                   "envbuild_node resource",
                                   hint="start nodes with `ray start --address HEAD "
                                        "--resources '{\"envbuild_node\": 1}'`")
        kill_orphan_daemons({n["NodeID"] for n in nodes})
        daemons, missing = find_daemons(nodes, timeout)
        if missing and start:
            daemons.update(start_daemons(config, node_ids=missing, timeout=timeout,
                                         runtime_env=runtime_env))
        if not daemons:
            raise FleetUnavailable("no fleet daemon runs on the cluster",
                                   hint="start them with `envbuild fleet start` (or "
                                        "Fleet.connect(start=True))")
        return cls(store, opened, daemons, owns_ray=owns, config=config, status_ttl=status_ttl,
                   node_batch=node_batch)

    # -- nodes ------------------------------------------------------------------------------

    def _daemon(self, node_id: str) -> Any:
        handle = self._daemons.get(node_id)
        if handle is None:
            raise node_lost(node_id, "no daemon known for it")
        return handle

    def call(self, node_id: str, method: str, *args: Any,
             timeout: float = CALL_TIMEOUT) -> Any:
        """One daemon method, waited on with ``timeout`` (errors as the module says)."""
        handle = self._daemon(node_id)
        try:
            return self._calls.wait(self._calls.submit(handle, method, *args), timeout, node_id)
        except NodeLost:
            self._forget_if_dead(node_id)
            raise

    def _forget_if_dead(self, node_id: str) -> None:
        """A daemon whose Ray node is dead can never come back (it is pinned to that node):
        kill its actor, so no restarting actor is left waiting for the node forever."""
        if self._calls.node_alive(node_id):
            return  # a crashed daemon Ray is restarting: it re-adopts its sandboxes
        handle = self._daemons.pop(node_id, None)
        if handle is not None:
            self._calls.kill(handle)

    def _all(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT,
             skip_lost: bool = False) -> dict[str, Any]:
        refs = {nid: self._calls.submit(h, method, *args) for nid, h in self._daemons.items()}
        out = {}
        for nid, ref in refs.items():
            try:
                out[nid] = self._calls.wait(ref, timeout, nid)
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

        try:
            resolved = self.resolve(lock)
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

    def resolve(self, lock: str) -> Any:
        """The ``ResolvedLock`` of a lock ref or digest in the fleet's store (its layers, user,
        workdir, env), read from the store once per digest (a digest names one content
        forever; a ref is looked up every time). ``LockNotFound`` if there is none."""
        from runtime_shim.node.locks import lock_digest, resolve

        digest = lock_digest(self.store, lock)
        hit = self._locks.get(digest)
        if hit is None:
            hit = self._locks[digest] = resolve(self.store, digest)
        return hit

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
                got.extend(handles(self, self.call(nid, "claim", spec, n - len(got), first),
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
            options = req[2] if len(req) > 2 else {}
            spec, resolved = self._spec(lock, **{
                "backend": "container", "lazy": False, "network": False, "limits": None,
                "ttl": None, "exec_log": False, "labels": None, "seccomp": None, **kwargs,
                **options})
            specs.append((spec, resolved, n))
        return self._create_specs(specs, placement_policy)

    def _create_specs(self, specs: Sequence[tuple[CreateSpec, Any, int]], policy: str,
                      first: FirstExec | None = None, *, fresh: bool = False
                      ) -> list[list[FleetSandbox]]:
        layers = tuple(sorted({x.digest for _, r, _ in specs for x in r.layers}))
        keys = tuple(spec.pool_key() for spec, _, _ in specs)
        status, viewed = self._statuses((layers, keys), fresh)
        if not status:
            raise FleetUnavailable("every node of the fleet is lost",
                                   hint="`envbuild fleet nodes`; add nodes with envbuild_node")
        groups = [placement.Group(layers={x.digest: x.size for x in r.layers}, n=n,
                                  memory=(spec.limits or Limits()).memory_bytes or 0,
                                  warm={s.node_id: ready for s in status
                                        for k, ready in s.pools if k == key and ready})
                  for (spec, r, n), key in zip(specs, keys, strict=True)]
        plans = placement.plan_groups(status, groups, policy=policy, chunk=self._node_batch)
        self._view.placed([Placed(counts, g.memory, tuple(g.layers), key)
                           for g, counts, key in zip(groups, plans, keys, strict=True)])
        try:
            return self._create_batches([(spec, counts) for (spec, _, _), counts
                                         in zip(specs, plans, strict=True)], first)
        except RuntimeShimError as e:
            self._view.drop()
            if not viewed or e.reference != "fleet-full":
                raise
        # a node was fuller than the view said (another driver's creates): plan once more
        return self._create_specs(specs, policy, first, fresh=True)

    def _statuses(self, query: tuple[tuple[str, ...], tuple[str, ...]], fresh: bool
                  ) -> tuple[list[NodeStatus], bool]:
        """The nodes' statuses for ``query`` (layers, pool keys): from the view when it has
        them (True), else asked of every node by one thread at a time (False)."""
        if not fresh and (status := self._view.get(query)) is not None:
            return status, True
        with self._view.refreshing(query):  # the other threads wait for this answer
            if not fresh and (status := self._view.get(query)) is not None:
                return status, True
            status = self.nodes(*query)
            self._view.put(query, status)
            return status, False

    def _create_batches(self, batches: Sequence[tuple[CreateSpec, Mapping[str, int]]],
                        first: FirstExec | None = None) -> list[list[FleetSandbox]]:
        refs = [[(nid, k, self._calls.submit(self._daemon(nid), "create_batch", spec, k, first))
                 for nid, k in counts.items()] for spec, counts in batches]
        made: list[list[Any]] = []
        errors: list[BaseException] = []
        for group in refs:
            records: list[Any] = []
            for nid, k, ref in group:
                try:
                    records.extend(self._calls.wait(ref, CALL_TIMEOUT + CREATE_PER_SANDBOX * k,
                                                    nid))
                except Exception as e:  # noqa: BLE001 - the others are closed, then raised
                    errors.append(e)
            made.append(records)
        if errors:
            for record in (r[0] if first else r for rs in made for r in rs):
                with contextlib.suppress(EnvbuildError):
                    self.call(record.node_id, "close", split_fleet_id(record.id)[0])
            raise errors[0]
        return [handles(self, rs, first) for rs in made]

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
        ray = ray_api()
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
        digest = self._spec(lock, backend="container", lazy=False, network=False, limits=None,
                            ttl=None, exec_log=False, labels=None, seccomp=None)[0].lock \
            if lock else None
        want = tuple(sorted((labels or {}).items()))
        found = self._all("close_all", digest, want, skip_lost=True)
        return sorted(fleet_id(sid, nid) for nid, ids in found.items() for sid in ids)

    def gc(self) -> builtins.list[str]:
        """Every node's expired and unowned sandboxes removed: their fleet ids."""
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
        ray = ray_api()
        closed = self._all("shutdown", remove, skip_lost=True)
        for handle in self._daemons.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        wait_unnamed([actor_name(nid) for nid in self._daemons])
        self._daemons = {}
        return sorted(fleet_id(s, nid) for nid, ids in closed.items() for s in ids)

    def disconnect(self) -> None:
        """Leave the cluster (if ``connect`` joined it); sandboxes stay with their daemons."""
        if self._owns_ray:
            ray_api().shutdown()
            self._owns_ray = False

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()


# the handles live in runtime_shim.fleet.handle, the cluster connection in .cluster;
# importable from here as before
__all__ = ["CALL_TIMEOUT", "CREATE_PER_SANDBOX", "DAEMON_CONCURRENCY", "EXEC_MARGIN",
           "AsyncFleetSandbox", "FastForward", "Fleet", "FleetSandbox", "start_daemons"]
