"""The training-job manifest model (``JobManifest``, ``SandboxGroup``, ``Pinned``, ...).

A job manifest (``kind: JobManifest``, YAML or JSON) lists groups of sandboxes a training job
launches. The schema is ``envbuild/defs/schema/jobmanifest.json``; ``envbuild.jobs`` loads a
file against it (``FILE:LINE:COL`` errors with hints), pins it (``envbuild job resolve``) and
verifies it against a store (``envbuild job verify``). This module is the model only: it
imports nothing but ``envbuild.errors`` at module level, so the runtime shim
(``envbuild.jobs.start``) reads manifests without loading definition or planning code::

    apiVersion: envbuild/v1
    kind: JobManifest
    name: swe-rl-batch-7                  # optional
    groups:
      - name: swe                         # optional, unique
        lock: env/swe-requests            # a ref (env name, env/NAME, snap/NAME) or sha256:...
        count: 64                         # sandboxes of this group (default 1, at most 100000)
        backend: container                # container | microvm (default container)
        network: false                    # default false
        limits: {pids: 256, memory: 2GiB, nofile: 1024, output_bytes: 16MiB}  # defaults shown

**Resolved** (``envbuild job resolve``): every ``lock`` is a digest and every group carries
``pinned``: where the digest came from and the exact bytes the lock closes over, so a resolved
manifest means the same sandboxes forever (and GC keeps them: ``envbuild gc --job FILE``)::

        lock: sha256:5f1c...
        pinned:
          ref: env/swe-requests           # the ref it was pinned from (informational)
          config: sha256:...              # the lock's OCI config
          layers:                         # bottom to top, as in the lock
            - {digest: sha256:..., size: 1234, toc: sha256:...}

Defaults are written out in a resolved manifest, sizes as ``<n>KiB|MiB|GiB|TiB`` when exact.
Resolving a resolved manifest gives the same manifest, byte for byte.

SDK: ``envbuild.jobs.create_sandbox(group, store=..., node_dir=...)`` starts one sandbox
of a resolved group (checking the lock still closes over the pinned layers), or pass the options yourself:
``Sandbox.create(group.lock, store=..., node_dir=..., **group.sandbox_options())``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from envbuild.errors import RuntimeShimError

if TYPE_CHECKING:
    from runtime_shim import Limits
    from runtime_shim.node import ResolvedLock

API_VERSION = "envbuild/v1"
KIND = "JobManifest"
BACKENDS = ("container", "microvm")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# Defaults, the same as runtime_shim.sdk.sandbox.Limits (kept here so the model imports nothing
# heavy; tests/unit/test_jobs_model.py checks they agree).
DEFAULT_PIDS = 256
DEFAULT_MEMORY = 2 << 30
DEFAULT_NOFILE = 1024
DEFAULT_OUTPUT_BYTES = 16 << 20


def is_digest(value: str) -> bool:
    return bool(_DIGEST.fullmatch(value))


def parse_size(value: int | str) -> int:
    """``2147483648``, ``"2GiB"``, ``"2G"``, ``"512 MiB"`` → bytes (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if not m:
        raise RuntimeShimError(f"not a size: {value!r}", hint="use bytes or e.g. 512MiB, 2GiB")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(n: int) -> int | str:
    """The inverse of ``parse_size`` for what a resolved manifest writes: ``2GiB`` if exact."""
    for unit in ("T", "G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}iB"
    return n


@dataclasses.dataclass(frozen=True)
class GroupLimits:
    """Limits of each sandbox of a group (``runtime_shim.sdk.sandbox.Limits``). A limit left out
    is the default; there is no "no limit" (the schema refuses ``null``, and ``from_mapping``
    reads a ``None`` that got past it as the default, never as "off")."""

    pids: int = DEFAULT_PIDS
    memory: int = DEFAULT_MEMORY
    nofile: int = DEFAULT_NOFILE
    output_bytes: int = DEFAULT_OUTPUT_BYTES

    @classmethod
    def from_mapping(cls, obj: Mapping[str, Any]) -> GroupLimits:
        def get(key: str, default: int | str) -> Any:
            value = obj.get(key)
            return default if value is None else value

        return cls(pids=get("pids", DEFAULT_PIDS), memory=parse_size(get("memory", DEFAULT_MEMORY)),
                   nofile=get("nofile", DEFAULT_NOFILE),
                   output_bytes=parse_size(get("output_bytes", DEFAULT_OUTPUT_BYTES)))

    def to_mapping(self) -> dict[str, Any]:
        return {"pids": self.pids, "memory": format_size(self.memory),
                "nofile": self.nofile, "output_bytes": format_size(self.output_bytes)}

    def to_limits(self) -> Limits:
        from runtime_shim import Limits

        return Limits(pids=self.pids, memory_bytes=self.memory, nofile=self.nofile,
                      output_bytes=self.output_bytes)


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
    """One entry of a job manifest: ``count`` sandboxes of ``lock`` with the same options."""

    lock: str
    name: str | None = None
    count: int = 1
    backend: str = "container"
    network: bool = False
    limits: GroupLimits = GroupLimits()
    pinned: Pinned | None = None

    @classmethod
    def from_mapping(cls, obj: Mapping[str, Any]) -> SandboxGroup:
        pinned = obj.get("pinned")
        return cls(lock=obj["lock"], name=obj.get("name"), count=obj.get("count", 1),
                   backend=obj.get("backend", "container"), network=obj.get("network", False),
                   limits=GroupLimits.from_mapping(obj.get("limits") or {}),
                   pinned=None if pinned is None else Pinned.from_mapping(pinned))

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name} if self.name else {}
        out.update(lock=self.lock, count=self.count, backend=self.backend,
                   network=self.network, limits=self.limits.to_mapping())
        if self.pinned is not None:
            out["pinned"] = self.pinned.to_mapping()
        return out

    @property
    def label(self) -> str:
        """How messages name the group: its name, else its lock."""
        return self.name or self.lock

    @property
    def resolved(self) -> bool:
        return is_digest(self.lock) and self.pinned is not None

    def blobs(self) -> list[str]:
        """Every blob the group needs: lock manifest, config, layers (pinned or a bare digest)."""
        out = [self.lock] if is_digest(self.lock) else []
        if self.pinned is not None:
            out += [self.pinned.config, *(layer.digest for layer in self.pinned.layers)]
        return out

    def sandbox_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Sandbox.create`` for this group (backend, network, limits)."""
        return {"backend": self.backend, "network": self.network,
                "limits": self.limits.to_limits()}

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

