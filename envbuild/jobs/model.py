"""The training-job manifest model (``JobManifest``, ``SandboxGroup``, ``Pinned``, ...).

A job manifest (``kind: JobManifest``, YAML or JSON) lists groups of sandboxes a training job
launches. The schema is ``envbuild/defs/schema/jobmanifest.json``; ``envbuild.jobs`` loads a
file against it (``FILE:LINE:COL`` errors with hints), pins it (``envbuild job resolve``) and
verifies it against a store (``envbuild job verify``). This module is the model only: it
imports only foundation modules (``envbuild.errors``, ``.sizes``, ``.oci``) at module level and
the runtime's ``Limits`` on first use, so the runtime shim (``envbuild.jobs.start``) reads
manifests without loading definition or planning code::

    apiVersion: envbuild/v1
    kind: JobManifest
    name: swe-rl-batch-7                  # optional
    groups:
      - name: swe                         # optional, unique
        lock: env/swe-requests            # a ref (env name, env/NAME, snap/NAME) or sha256:...
                                          # or, instead of lock, task: NAME|task/NAME|sha256:...
        count: 64                         # sandboxes of this group (default 1, at most 100000)
        backend: container                # a registered backend: container, fncall, microvm
        network: false                    # default false
        limits: {pids: 256, memory_bytes: 2GiB, disk_bytes: 10GiB}  # runtime_shim.Limits

``limits`` are the SDK's ``Limits``, field for field and by the same names: ``pids``,
``memory_bytes``, ``nofile``, ``cpus``, ``output_bytes``, ``exec_timeout`` (seconds),
``disk_bytes``, ``inodes``, ``cpu_class``, ``inotify``; sizes in ``envbuild.sizes``' grammar
(``memory`` is still read as ``memory_bytes``). A limit left out is ``Limits()``'s default;
``cpus`` left out is the default share of the node each sandbox starts on.

**Resolved** (``envbuild job resolve``): every ``lock`` is a digest and every group carries
``pinned``: where the digest came from and the exact bytes the lock closes over, so a resolved
manifest means the same sandboxes forever (and GC keeps them: ``envbuild gc --job FILE``)::

        lock: sha256:5f1c...
        pinned:
          ref: env/swe-requests           # the ref it was pinned from (informational)
          config: sha256:...              # the lock's OCI config
          layers:                         # bottom to top, as in the lock
            - {digest: sha256:..., size: 1234, toc: sha256:...}

A group may name a **task** (``task: NAME``, ``task/NAME`` or a task lock's digest;
``runtime_shim.node.tasklock``) instead of a lock: its sandboxes are made from the task's env
lock, the agent's env without the hidden layer. Resolved, ``task`` is the task lock's digest
and ``lock`` its env lock's digest, so the manifest says which task lock grades the group's
sandboxes (``envbuild gc --job`` keeps it, its hidden layer and its spec).

Defaults are written out in a resolved manifest (but an unset ``cpus``), sizes as
``<n>KiB|MiB|GiB|TiB`` when exact.
Resolving a resolved manifest gives the same manifest, byte for byte.

SDK: ``envbuild.jobs.create_sandbox(group, store=..., node_dir=...)`` starts one sandbox
of a resolved group (checking the lock still closes over the pinned layers), or pass the options yourself:
``Sandbox.create(group.lock, store=..., node_dir=..., **group.sandbox_options())``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from envbuild.errors import RuntimeShimError
from envbuild.oci import is_digest
from envbuild.sizes import format_size, parse_size

if TYPE_CHECKING:
    from runtime_shim import Limits
    from runtime_shim.node import ResolvedLock

API_VERSION = "envbuild/v1"
KIND = "JobManifest"
#: The limits that are sizes (``envbuild.sizes``: ``2GiB``, ``512M``, bytes).
SIZE_LIMITS = frozenset({"memory_bytes", "output_bytes", "disk_bytes"})
#: Names a manifest may still use for a limit, and the ``Limits`` field each means.
OLD_LIMIT_NAMES = {"memory": "memory_bytes"}


def limits_from_mapping(obj: Mapping[str, Any]) -> Limits:
    """The ``Limits`` of a group's ``limits:`` mapping: the SDK's field names (``memory`` is
    still read as ``memory_bytes``), sizes through ``envbuild.sizes``; a limit left out is
    ``Limits()``'s default, and so is a ``None`` that got past the schema (the manifest has no
    "no limit")."""
    from runtime_shim import Limits

    given = {OLD_LIMIT_NAMES.get(k, k): v for k, v in obj.items() if v is not None}
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(Limits)})
    if unknown:
        raise RuntimeShimError(f"unknown limit {unknown[0]!r}",
                               hint=f"limits are the SDK's Limits fields: {limit_names()}")
    for key in SIZE_LIMITS & set(given):
        given[key] = parse_size(given[key], what=f"limits.{key}")
    return Limits(**given)


def limits_to_mapping(limits: Limits, *, cpus: bool = True) -> dict[str, Any]:
    """``limits`` as a manifest writes them: every field, sizes as ``2GiB`` when exact;
    without ``cpus`` when ``cpus`` is false (left to each node's default share)."""
    out = {}
    for field in dataclasses.fields(limits):
        value = getattr(limits, field.name)
        if field.name == "cpus" and not cpus:
            continue
        out[field.name] = format_size(value) if field.name in SIZE_LIMITS and value is not None \
            else value
    return out


def limit_names() -> str:
    from runtime_shim import Limits

    return ", ".join(f.name for f in dataclasses.fields(Limits))


@dataclasses.dataclass(frozen=True)
class PinnedLayer:
    digest: str
    size: int
    toc: str

    def to_mapping(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size, "toc": self.toc}


@dataclasses.dataclass(frozen=True)
class Pinned:
    """What ``envbuild job resolve`` recorded for a group: the ref the lock was pinned from
    (``None`` when it was given as a digest), its config and its layers, bottom to top."""

    ref: str | None
    config: str
    layers: tuple[PinnedLayer, ...]

    @classmethod
    def from_mapping(cls, obj: Mapping[str, Any]) -> Pinned:
        return cls(ref=obj.get("ref"), config=obj["config"],
                   layers=tuple(PinnedLayer(d["digest"], d["size"], d["toc"])
                                for d in obj["layers"]))

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ref": self.ref} if self.ref else {}
        out["config"] = self.config
        out["layers"] = [layer.to_mapping() for layer in self.layers]
        return out


@dataclasses.dataclass(frozen=True)
class SandboxGroup:
    """One entry of a job manifest: ``count`` sandboxes of ``lock`` with the same options;
    ``task`` the task lock they are graded by ("" lock: the task's env lock, set by resolve)."""

    lock: str
    name: str | None = None
    count: int = 1
    backend: str = "container"
    network: bool = False
    limits: Limits = dataclasses.field(default_factory=lambda: limits_from_mapping({}))
    pinned: Pinned | None = None
    #: the manifest left ``limits.cpus`` out: each sandbox gets the default share of the host
    #: it starts on (``Limits.cpus``: half its cores), never that of the host that read or
    #: resolved the manifest, and a written manifest leaves it out again
    node_cpus: bool = False
    task: str | None = None

    @classmethod
    def from_mapping(cls, obj: Mapping[str, Any]) -> SandboxGroup:
        pinned = obj.get("pinned")
        limits = obj.get("limits") or {}
        return cls(lock=obj.get("lock", ""), task=obj.get("task"), name=obj.get("name"),
                   count=obj.get("count", 1),
                   backend=obj.get("backend", "container"), network=obj.get("network", False),
                   limits=limits_from_mapping(limits),
                   node_cpus=limits.get("cpus") is None,
                   pinned=None if pinned is None else Pinned.from_mapping(pinned))

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name} if self.name else {}
        if self.task:
            out["task"] = self.task
        if self.lock:
            out["lock"] = self.lock
        out.update(count=self.count, backend=self.backend,
                   network=self.network,
                   limits=limits_to_mapping(self.sandbox_limits(), cpus=not self.node_cpus))
        if self.pinned is not None:
            out["pinned"] = self.pinned.to_mapping()
        return out

    @property
    def label(self) -> str:
        """How messages name the group: its name, else its lock (or task)."""
        return self.name or self.lock or self.task or "?"

    @property
    def resolved(self) -> bool:
        return is_digest(self.lock) and self.pinned is not None and (
            self.task is None or is_digest(self.task))

    def blobs(self) -> list[str]:
        """Every blob the group needs: task lock and lock manifests, config, layers (pinned or
        a bare digest)."""
        out = [d for d in (self.task, self.lock) if d and is_digest(d)]
        if self.pinned is not None:
            out += [self.pinned.config, *(layer.digest for layer in self.pinned.layers)]
        return out

    def sandbox_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Sandbox.create`` for this group (backend, network, limits)."""
        return {"backend": self.backend, "network": self.network,
                "limits": self.sandbox_limits()}

    def sandbox_limits(self) -> Limits:
        """The ``Limits`` of each sandbox of the group, made here (``node_cpus``: this host's
        default share of CPU)."""
        from runtime_shim import Limits

        if not self.node_cpus:
            return self.limits
        return dataclasses.replace(self.limits, cpus=Limits().cpus)

    def require_resolved(self) -> Pinned:
        """The pinned closure; ``RuntimeShimError`` if the group was never resolved."""
        if not self.resolved or self.pinned is None:
            raise RuntimeShimError(f"job group {self.label!r} is not resolved",
                                   hint="run `envbuild job resolve FILE` and use the "
                                        "resolved manifest")
        return self.pinned

    def check_lock(self, lock: ResolvedLock) -> None:
        """Refuse a lock that is not the one this group pinned (``RuntimeShimError``)."""
        pinned = self.require_resolved()
        got = [(layer.digest, layer.toc_digest) for layer in lock.layers]
        want = [(layer.digest, layer.toc) for layer in pinned.layers]
        if lock.digest != self.lock or got != want or \
                lock.manifest.get("config", {}).get("digest") != pinned.config:
            raise RuntimeShimError(
                f"job group {self.label!r}: lock {lock.digest} does not close over the pinned "
                f"config and layers", hint="the resolved manifest was edited; resolve it again")


@dataclasses.dataclass(frozen=True)
class JobManifest:
    """A whole manifest. ``from_mapping`` takes a schema-valid mapping (``envbuild.jobs``
    checks it against the schema; this only builds the model)."""

    groups: tuple[SandboxGroup, ...]
    name: str | None = None
    description: str | None = None

    @classmethod
    def from_mapping(cls, obj: Mapping[str, Any]) -> JobManifest:
        if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
            raise RuntimeShimError(f"not an {API_VERSION} {KIND}",
                                   hint="load it with envbuild.jobs.load_job_manifest")
        return cls(groups=tuple(SandboxGroup.from_mapping(g) for g in obj["groups"]),
                   name=obj.get("name"), description=obj.get("description"))

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
        if self.name:
            out["name"] = self.name
        if self.description:
            out["description"] = self.description
        out["groups"] = [g.to_mapping() for g in self.groups]
        return out

    @property
    def resolved(self) -> bool:
        return all(g.resolved for g in self.groups)

    def blobs(self) -> list[str]:
        """Every blob digest the manifest names, once each."""
        return list(dict.fromkeys(d for g in self.groups for d in g.blobs()))

