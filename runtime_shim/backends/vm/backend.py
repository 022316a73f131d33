"""``MicroVmBackend``: a sandbox as a QEMU microVM, behind the same ``Backend`` protocol
(``runtime_shim.backends.base``).

Its handle is ``MicroVmSandbox`` (``runtime_shim.backends.vm.sandbox``: the VM's files, disks,
exec, pack-diff and checkpoints), planned as data by ``runtime_shim.backends.vm.plan`` (options,
layer transport, config disk, drives, devices).

Isolation boundary: the guest's own kernel, so a seccomp profile is refused for
``backend="microvm"``; a VM is a child of the process that created it, so it can be neither
kept past that process nor attached to from another one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from envbuild.errors import (
    BackendUnavailable,
    CheckpointRefused,
    RuntimeShimError,
)
from runtime_shim.backends.base import CheckpointImage, CreateRequest
from runtime_shim.backends.vm import checkpoint as ckpt
from runtime_shim.backends.vm.plan import (
    CONFIG_DISK_SIZE,
    LAYER_TRANSPORTS,
    MAX_LAYERS,
    VM_DISK_UNLIMITED,
    VmOptions,
    choose_layer_transport,
    guest_config,
    vm_drives,
    vm_pmem,
)
from runtime_shim.backends.vm.sandbox import MIGRATION_CAPS, MicroVmSandbox, VmMemoryInfo
from runtime_shim.node.admission import (
    Reservation,
    vm_reservation,
)
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.locks import ResolvedLock
from runtime_shim.node.model import Limits


class MicroVmBackend:
    """The ``microvm`` backend (``runtime_shim.backends.base.Backend``). A VM is a child of the
    process that created it (QEMU dies with its creator's session): it can be neither kept
    past that process nor attached to from another one."""

    name = "microvm"

    def host_reservation(self, limits: Limits) -> Reservation:
        """``backend.HostCosted``: the guest's processes and files are its own."""
        return vm_reservation(limits)

    def check(self, *, keep: bool, seccomp: str | Mapping | None, lazy: bool) -> None:
        if keep:
            raise BackendUnavailable("keep=True works with the container backend only",
                                     hint="a microVM dies with the process that started it; "
                                          "use backend=\"container\" to keep a sandbox")
        if isinstance(seccomp, Mapping):
            raise RuntimeShimError("a seccomp profile applies to container sandboxes only",
                                   hint="a microVM's boundary is its own guest kernel; "
                                        "pass seccomp=None for it")

    def create(self, req: CreateRequest) -> MicroVmSandbox:
        # the guest composes the layers; only the node cache's unpacked dirs are needed here
        return MicroVmSandbox(req.id, req.paths.root, req.lock, req.node, req.layer_dirs,
                              network=req.network, limits=req.limits)

    def restored_limits(self, image: CheckpointImage) -> Limits | None:
        """The checkpointed VM's RAM: its devices must match the image's."""
        record = ckpt.VmCheckpoint.from_record(image.record)
        return Limits(memory_bytes=int(record.model["memory_mib"]) << 20)

    def restore(self, req: CreateRequest, image: CheckpointImage) -> MicroVmSandbox:
        """A new sandbox (``req``, as for ``create``) continuing from ``image`` (kind
        ``qemu``, ``MicroVmSandbox.checkpoint``; ``runtime_shim.backends.base.Restorable``): no
        kernel boot. The VM's own disk image holds its files, so layers of ``req.lock`` above
        the checkpoint's (the SDK's snapshot layer) are not attached; the rest must be the
        checkpoint's. Files or devices that differ from ``image.record`` raise
        ``CheckpointRefused`` before QEMU starts."""
        if image.kind != "qemu":
            raise CheckpointRefused(f"a {image.kind!r} checkpoint is not a microVM's",
                                    hint="restore it with the backend that made it")
        record = ckpt.VmCheckpoint.from_record(image.record)
        n = len(record.model.get("layers", ()))
        lock = req.lock
        if tuple(layer.digest for layer in lock.layers[:n]) != tuple(record.model["layers"]):
            raise CheckpointRefused("restore microVM checkpoint: its layers are not this lock's",
                                    context=f"checkpoint of lock {record.lock}")
        lock = dataclasses.replace(lock, layers=lock.layers[:n])
        return MicroVmSandbox(req.id, req.paths.root, lock, req.node, req.layer_dirs[:n],
                              network=req.network, limits=req.limits,
                              restore=(record, Path(image.dir)))

    def attach(self, paths: SandboxPaths, layout: NodeLayout, lock: ResolvedLock,
               runtime: str) -> MicroVmSandbox:
        raise BackendUnavailable(
            f"sandbox {paths.id} is a microVM: it cannot be attached to from another process",
            hint="QEMU is a child of the process that created the VM and its agent line is "
                 "that process's; use the container backend for sandboxes shared between "
                 "processes")

    def remove(self, layout: NodeLayout, sandbox_id: str, runtime: str) -> None:
        """Kill the sandbox's QEMU if it still runs (its pid file), so the dir can go."""
        pid_file = layout.sandbox(sandbox_id).root / "qemu.pid"
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if _is_qemu(pid, layout.sandbox(sandbox_id).root):
                os.kill(pid, signal.SIGKILL)


def _is_qemu(pid: int, root: Path) -> bool:
    """``pid`` is a QEMU of this sandbox (its command line names the sandbox dir), not a
    process that reused the pid."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(root).encode() in cmdline


# the plan's and the sandbox's names, importable from here as before
__all__ = ["CONFIG_DISK_SIZE", "LAYER_TRANSPORTS", "MAX_LAYERS", "MIGRATION_CAPS",
           "VM_DISK_UNLIMITED", "MicroVmBackend", "MicroVmSandbox", "VmMemoryInfo", "VmOptions",
           "choose_layer_transport", "guest_config", "vm_drives", "vm_pmem"]
