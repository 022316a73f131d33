"""The fleet's plain data, shared by the client and the node daemons.

The daemon's ``DaemonConfig``, what to create (``CreateSpec``), what a daemon reports (``SandboxRecord``,
``NodeStatus``), and fleet ids (``SDK-ID@NODE``). No Ray, no threads, no sandboxes: every value
here crosses the Ray boundary by pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envbuild.errors import SandboxNotFound
from runtime_shim.node.model import Limits

NAMESPACE = "envbuild"
ACTOR_PREFIX = "envbuild-node-"
#: The lease of a sandbox created without ``ttl=`` (seconds).
DEFAULT_TTL = 3600.0


#: A command to run in each new sandbox within its create call: ``(cmd, Sandbox.exec kwargs)``.
FirstExec = tuple[Any, Mapping[str, Any]]


def actor_name(node_id: str) -> str:
    """The Ray actor name of the daemon of Ray node ``node_id`` (hex)."""
    return ACTOR_PREFIX + node_id


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """How a node daemon runs. ``store``: an ``s3://BUCKET/PREFIX`` URL or a directory every
    node can read; ``node_dir``: the node dir, ``{node_id}`` replaced by the Ray node id;
    ``slots`` / ``memory_bytes``: capacity (sandboxes; sum of their ``Limits.memory_bytes``,
    None: 4 × the host's memory, since limits are caps, not reservations); ``max_starting``:
    admission control; ``runtime``: the OCI runtime; ``niceness``: the nice value the daemon's
    threads, and so the sandboxes they start, run at (Ray starts its workers at 15, which on a
    busy node starves starts and execs behind every normal process; None: leave Ray's);
    ``workers``: processes that run the node's starts (``runtime_shim.fleet.workers``; 0: the
    daemon's own threads, under its one GIL); ``data_host``: the address the daemon's data
    plane listens on (``runtime_shim.fleet.dataplane``; None: exec and files over Ray only)."""

    store: str
    node_dir: str
    s3_endpoint: str | None = None
    slots: int = 256
    memory_bytes: int | None = None
    max_starting: int = 4
    runtime: str = "runc"
    reap_interval: float = 1.0
    niceness: int | None = 0
    workers: int = 0
    data_host: str | None = None

    def node_dir_for(self, node_id: str) -> str:
        return self.node_dir.replace("{node_id}", node_id)


@dataclasses.dataclass(frozen=True)
class CreateSpec:
    """What to create (one ``Fleet.create`` call): ``lock`` is a digest (the client resolved
    it); the rest are ``Sandbox.create``'s arguments; ``ttl`` the lease (None: ``DEFAULT_TTL``);
    ``exec_log``: record every exec and file write in the store (``runtime_shim.fleet.execlog``);
    ``labels``: free-form ``(key, value)`` pairs that ``list``/``close_all`` filter on."""

    lock: str
    backend: str = "container"
    lazy: bool = False
    network: bool | tuple[str, ...] = False
    limits: Limits | None = None
    seccomp: str | None = None
    ttl: float | None = None
    exec_log: bool = False
    labels: tuple[tuple[str, str], ...] = ()

    def pool_key(self) -> str:
        """What makes two warm sandboxes interchangeable (not lease, log or labels)."""
        return _pool_key(self.lock, self.backend, self.lazy, self.network, self.limits,
                         self.seccomp)


@functools.lru_cache(maxsize=1024)
def _pool_key(lock: str, backend: str, lazy: bool, network: bool | tuple[str, ...],
              limits: Limits | None, seccomp: str | None) -> str:
    """``CreateSpec.pool_key`` (every create asks it twice: computed once per spec)."""
    ident = {"lock": lock, "backend": backend, "lazy": lazy,
             "network": list(network) if isinstance(network, tuple) else network,
             "limits": dataclasses.asdict(limits or Limits()), "seccomp": seccomp}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class SandboxRecord:
    """One fleet sandbox as its daemon reports it. ``id`` is ``SDK-ID@NODE`` (``fleet_id``).
    ``data_addr`` and ``token``: its daemon's data plane and the sandbox's token there, in the
    records handed to its creator or attacher only (``runtime_shim.fleet.dataplane``)."""

    id: str
    node_id: str
    lock: str
    backend: str
    created: float
    ready: float
    lease_expires: float
    exec_log: str | None
    labels: tuple[tuple[str, str], ...] = ()
    data_addr: tuple[str, int] | None = None
    token: str | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    """One node's capacity and load (``Fleet.nodes()``). ``cached``: of the layers asked
    about, those already in its node cache (locality); ``pulled_bytes``: layer bytes this
    daemon has fetched from the store since it started; ``warm``: ready pooled sandboxes;
    ``pools``: ``(pool key, ready count)`` of the pools asked about."""

    node_id: str
    node_dir: str
    store: str
    slots: int
    used: int
    starting: int
    queued: int
    memory_bytes: int
    memory_used: int
    warm: int
    pulled_bytes: int
    cached: tuple[str, ...] = ()
    pid: int = 0
    pools: tuple[tuple[str, int], ...] = ()

    @property
    def free(self) -> int:
        return max(0, self.slots - self.used)


_SDK_ID = re.compile(r"eb-[0-9a-f]{12}")


def check_sdk_id(sandbox_id: object) -> str:
    """An SDK sandbox id (``eb-`` and 12 hex digits), never a path: ``SandboxNotFound``
    for anything else, before it is joined to the node dir."""
    if not isinstance(sandbox_id, str) or not _SDK_ID.fullmatch(sandbox_id):
        raise SandboxNotFound(f"{sandbox_id!r} is not a sandbox id",
                              hint="sandbox ids look like eb-0123456789ab")
    return sandbox_id


def fleet_id(sandbox_id: str, node_id: str) -> str:
    """The fleet's id of a sandbox: the SDK id and the first 12 hex digits of its Ray node."""
    return f"{sandbox_id}@{node_id[:12]}"


def split_fleet_id(value: str) -> tuple[str, str]:
    """``(sdk_id, node_prefix)`` of a fleet id, or ``SandboxNotFound`` if it is not one."""
    sdk_id, sep, node = value.partition("@")
    if not sep or not _SDK_ID.fullmatch(sdk_id) or len(node) != 12 or not all(
            c in "0123456789abcdef" for c in node):
        raise SandboxNotFound(f"{value!r} is not a fleet sandbox id",
                              hint="fleet ids look like eb-0123456789ab@0123456789ab; "
                                   "`envbuild fleet ls` lists them")
    return sdk_id, node


def memory_of(spec: CreateSpec) -> int:
    """What one sandbox of ``spec`` counts against a node's ``memory_bytes``."""
    limits = spec.limits or Limits()
    return limits.memory_bytes or 0


def matches(spec: CreateSpec, labels: Sequence[tuple[str, str]]) -> bool:
    """``spec`` carries every one of ``labels``."""
    have = set(spec.labels)
    return all(tuple(x) in have for x in labels)


def open_url(store: str, s3_endpoint: str | None):
    """What ``open_store`` takes for a fleet's store: an opened S3 store, or the directory."""
    if store.startswith("s3://"):
        from envbuild.store import open_store

        return open_store(store, s3_endpoint=s3_endpoint)
    return store


__all__ = ["ACTOR_PREFIX", "DEFAULT_TTL", "NAMESPACE", "CreateSpec", "DaemonConfig", "FirstExec",
           "NodeStatus", "SandboxRecord", "actor_name", "check_sdk_id", "fleet_id", "matches",
           "memory_of", "open_url", "split_fleet_id"]
