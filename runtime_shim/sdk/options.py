"""``SandboxOptions``: how to make a sandbox, as one value (``Sandbox.create(lock, options)``),
and ``plan_create``, the checks of it against its backend made before anything exists.

Pure: no disk, no store, no process. ``Sandbox.create`` takes the same names as keyword
arguments (``Sandbox.create(lock, backend="microvm", ttl=600)``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from envbuild.errors import BackendUnavailable, RuntimeShimError
from runtime_shim.backends.base import (
    Backend,
    CheckpointImage,
    HostCosted,
    Restorable,
    get_backend,
)
from runtime_shim.isolation import netns
from runtime_shim.isolation import seccomp as seccomp_profiles
from runtime_shim.node import admission, diskpool
from runtime_shim.node.model import Limits

_log = logging.getLogger("envbuild.sandbox")

#: The switches of the FUSE lazy stacks, which were removed (issue 36): a lazy create with
#: one set is refused rather than silently ignored (a benchmark or script still setting one
#: measures something that no longer exists).
FUSE_SWITCHES = tuple(f"ENVBUILD_LAZY_{s}" for s in (
    "PASSTHROUGH", "METALAYER", "METASERVER", "PRELOAD", "PYC_SOURCES", "PYDEPS", "PYINDEX",
    "PY_STARTUP", "READDIRPLUS", "NO_OPENDIR", "TREE_BUDGET", "FETCH_CONCURRENCY",
    "FETCH_TIMEOUT", "HEDGE_MS"))


@dataclasses.dataclass(frozen=True)
class SandboxOptions:
    """How to make a sandbox. Every field has a default.

    ``backend``: a name of the registry (``runtime_shim.backends.base.backend_names``):
    ``"container"`` (runc), ``"microvm"`` (QEMU) or ``"fncall"`` (stateless calls).

    ``network``: False for none; True for egress to the public internet through the sandbox's
    own namespace and user-mode NAT (the host, private ranges such as RFC 1918, CGNAT and
    link-local, and ``$ENVBUILD_NETWORK_REFUSE`` unreachable); a list of ``CIDR[:PORT]`` for
    egress to those only, private ones included, plus ``"public"`` for the public internet too
    (``runtime_shim.isolation.netns``). ``Sandbox.set_network`` changes it while it runs.

    ``limits``: what it may use (``Limits``; default ``Limits()``, or the checkpoint's for a
    ``restore`` where the backend keeps them in its image: a microVM's RAM). Admission
    (``runtime_shim.node.admission``) reserves their worst case of the host's shared tables
    before anything is made; past the node's budget, ``AdmissionRefused`` and nothing is left.

    ``runtime``: the OCI runtime of a container (``runc``). ``keep``: outlive this process
    (``envbuild run --keep``; container only). ``ttl``: seconds after which it is removed if
    nobody closed it. ``reap``: first remove the node's expired sandboxes and those whose
    creating process died.

    ``lazy``: do not pull and unpack the layers first: each layer's metadata is a kernel
    overlay over the node's object store, each file filled from the store on its first open
    by the node's fanotify filler (``runtime_shim.lazyfs.native``; Linux >= 6.14, root, a
    node dir on ext4/xfs/btrfs; the store must be one another process can open). Where the
    host or node dir cannot, and for a ``checkpointable`` sandbox or a ``restore`` (CRIU
    cannot dump files mapped from the layers' nested overlays), the layers are pulled in
    full with one logged line. ``"auto"``: the same, and a full pull also wherever else the
    layers cannot be served lazily (the backend, a store no other process can open);
    ``"native"``: the filler or a one-line refusal (``"fuse"``, the removed FUSE stacks:
    refused in one line).
    ``Sandbox.info().lazy`` says how reads are served (``native``; ``full pull: why``).

    ``seccomp``: None for the default syscall filter (``runtime_shim.isolation.seccomp``),
    ``"unconfined"`` for none, or a full OCI ``linux.seccomp`` object (checked). A microVM
    takes None or ``"unconfined"`` (its guest kernel bounds it).

    ``checkpointable``: ``checkpoint`` / ``fork`` will be asked of it. ``restore``: the
    processes continue from this checkpoint image (unpacked on the host; ``Sandbox.restore``
    reads one from the store); the backend refuses an image that does not match its record.
    """

    backend: str = "container"
    network: bool | Sequence[str] = False
    limits: Limits | None = None
    runtime: str = "runc"
    keep: bool = False
    lazy: bool | str = False
    seccomp: str | Mapping[str, Any] | None = None
    ttl: float | None = None
    reap: bool = True
    checkpointable: bool = False
    restore: CheckpointImage | None = None

    @classmethod
    def of(cls, options: SandboxOptions | None, fields: Mapping[str, Any]) -> SandboxOptions:
        """``options`` (default: all defaults) with ``fields`` replaced; an unknown name is a
        ``RuntimeShimError`` naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise RuntimeShimError(f"unknown sandbox option(s): {', '.join(unknown)}",
                                   hint=f"options are: {', '.join(sorted(known))}")
        return dataclasses.replace(options or cls(), **fields)


@dataclasses.dataclass(frozen=True)
class CreatePlan:
    """What ``plan_create`` settled: the backend, the parsed network policy, the limits, the
    lazy mode after the backend's say (``"auto"`` may have become False), the reservation;
    ``lazy_note``: why a lazy request became a full pull (``Sandbox.info().lazy``)."""

    impl: Backend
    network: netns.NetworkPolicy | None
    limits: Limits
    lazy: bool | str
    reservation: admission.Reservation
    budget: admission.BudgetSettings
    restorer: Restorable | None
    lazy_note: str = ""


def plan_create(options: SandboxOptions) -> CreatePlan:
    """Check ``options`` against their backend before anything is made: bad network entries, an
    unknown backend, a request it cannot honour, a bad TTL or lazy mode, a restore it cannot
    do, limits admission refuses outright."""
    policy = netns.parse_network(options.network)
    impl = get_backend(options.backend)
    seccomp_profiles.check_setting(options.seccomp)
    lazy, lazy_note = lazy_mode(options, os.environ)
    try:
        impl.check(keep=options.keep, seccomp=options.seccomp, lazy=bool(lazy))
    except BackendUnavailable:
        if lazy != "auto":
            raise
        lazy = False  # auto: this backend cannot run lazy layers, pull them in full
        impl.check(keep=options.keep, seccomp=options.seccomp, lazy=False)
    if options.ttl is not None and not options.ttl > 0:
        raise RuntimeShimError(f"ttl must be a positive number of seconds, not {options.ttl!r}")
    limits, restorer = options.limits, None
    if options.restore is not None:
        if not isinstance(impl, Restorable):
            raise BackendUnavailable(f"the {options.backend} backend cannot restore a "
                                     "checkpoint with memory")
        restorer = impl
        limits = limits or impl.restored_limits(options.restore)
    limits = limits or Limits()
    budget = admission.BudgetSettings.from_env(os.environ)
    want = impl.host_reservation(limits) if isinstance(impl, HostCosted) \
        else admission.reservation(limits, budget.files_overcommit)  # pids=None refused here
    if diskpool.pooled(limits, os.environ, options.backend):
        # the pool's size is reserved once; its sandboxes overcommit it (node.diskpool)
        want = dataclasses.replace(want, disk_bytes=0)
    return CreatePlan(impl=impl, network=policy, limits=limits, lazy=lazy, reservation=want,
                      budget=budget, restorer=restorer, lazy_note=lazy_note)


def lazy_mode(options: SandboxOptions, env: Mapping[str, str]) -> tuple[bool | str, str]:
    """``options.lazy`` checked: the mode to create with and, when a lazy request becomes a
    full pull here, why (logged once). A FUSE switch set in ``env`` with a native lazy mode
    is refused: it would change nothing."""
    lazy = options.lazy
    if lazy == "fuse":
        raise RuntimeShimError("lazy='fuse' is gone: the FUSE lazy stacks were removed",
                               hint="use lazy=True (the native filler, a full pull where it "
                                    "cannot run) or lazy='native'")
    if lazy not in (False, True, "auto", "native"):
        raise RuntimeShimError(f"lazy must be False, True, 'auto' or 'native', not {lazy!r}")
    fuse_only = [k for k in FUSE_SWITCHES if env.get(k)]
    if lazy and fuse_only:
        raise RuntimeShimError(
            f"{fuse_only[0]} is a switch of the FUSE lazy stacks, which were removed; "
            f"lazy={lazy!r} uses the native filler, which reads none of them",
            hint=f"unset {' '.join(fuse_only)}")
    if lazy and (options.checkpointable or options.restore is not None):
        # CRIU: "Can't lookup mount=N for fd=-3 path=/bin/busybox" (6.18, CRIU of this host)
        why = ("a checkpointable sandbox pulls its layers in full: CRIU cannot find the "
               "mount of the files it maps from the native layers' nested overlays")
        if lazy == "native":
            raise RuntimeShimError(f"a native lazy sandbox cannot be checkpointed ({why})",
                                   hint="use lazy=True (a full pull) or lazy=False with "
                                        "checkpointable=True")
        _log.warning("lazy=%r: %s", lazy, why)
        return False, f"full pull: {why}"
    return lazy, ""
