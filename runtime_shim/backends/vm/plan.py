"""What a microVM is made of, planned as data before anything runs.

Its options (``VmOptions``), how the layers reach the guest (``choose_layer_transport``), the config disk
(``guest_config``), the drives and pmem devices (``vm_drives``, ``vm_pmem``), and the QEMU request
and device model of one VM (``vm_request``, ``request_model``). ``runtime_shim.backends.vm.backend``
makes the files these name and runs QEMU; the disk contract with the guest is in its docstring.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envbuild.errors import BackendUnavailable, RuntimeShimError
from runtime_shim.backends.vm import checkpoint as ckpt
from runtime_shim.backends.vm import initramfs, qemu
from runtime_shim.backends.vm import kernel as vmkernel
from runtime_shim.node.locks import ResolvedLock
from runtime_shim.node.nodecache import parse_size

MAX_LAYERS = initramfs.MAX_LAYERS
CONFIG_DISK_SIZE = 4096
#: The writable disk's size when ``Limits.disk_bytes`` is None: a disk always has one.
VM_DISK_UNLIMITED = 64 << 30


@dataclasses.dataclass(frozen=True)
class VmOptions:
    vcpus: int = 1
    # The writable disk's size; None: the sandbox's Limits.disk_bytes (ENVBUILD_VM_DISK
    # overrides it). Sparse: costs the host what the guest writes, at most this.
    disk_bytes: int | None = None
    boot_timeout: float = 90.0  # TCG on a busy 2-core host takes seconds
    default_memory_bytes: int = 1 << 30  # when Limits.memory_bytes is None
    # How the read-only layers reach the guest (LAYER_TRANSPORTS): "auto" is "pmem-dax"
    # where the guest kernel and QEMU can, else "virtio-blk" (``choose_layer_transport``).
    layers: str = "auto"
    balloon: bool = True  # a virtio-balloon with free page reporting (freed memory goes back)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> VmOptions:
        opts = cls()
        if environ.get("ENVBUILD_VM_CPUS"):
            opts = dataclasses.replace(opts, vcpus=int(environ["ENVBUILD_VM_CPUS"]))
        if environ.get("ENVBUILD_VM_DISK"):
            opts = dataclasses.replace(opts, disk_bytes=parse_size(environ["ENVBUILD_VM_DISK"]))
        if environ.get("ENVBUILD_VM_LAYERS"):
            opts = dataclasses.replace(opts, layers=environ["ENVBUILD_VM_LAYERS"])
        if environ.get("ENVBUILD_VM_BALLOON"):
            opts = dataclasses.replace(opts, balloon=environ["ENVBUILD_VM_BALLOON"] not in
                                       ("0", "off", "no", "false"))
        return opts



#: ``VmOptions.layers`` values; the last two are what ``info().layer_transport`` reports.
LAYER_TRANSPORTS = ("auto", "pmem-dax", "virtio-blk")


def choose_layer_transport(wanted: str, kern: vmkernel.GuestKernel, qemu_bin: str
                           ) -> tuple[str, str | None]:
    """``(transport, why)``: ``pmem-dax`` (each layer image a virtio-pmem device on the q35
    machine, mounted ``-o dax`` by the guest: one copy of its pages in the host's page cache
    serves every VM) when asked for or ``auto`` and both the guest kernel
    (``kernel.pmem_dax_missing``) and QEMU (``virtio-pmem-pci``) can, else ``virtio-blk``
    (microvm, each guest caching its own copy) with ``why`` saying what was missing.
    ``pmem-dax`` asked for and impossible raises ``BackendUnavailable``."""
    if wanted not in LAYER_TRANSPORTS:
        raise RuntimeShimError(f"ENVBUILD_VM_LAYERS={wanted!r} is not one of "
                               f"{', '.join(LAYER_TRANSPORTS)}")
    if wanted == "virtio-blk":
        return "virtio-blk", "asked for"
    why = vmkernel.pmem_dax_missing(kern)
    if why is None and "virtio-pmem-pci" not in qemu.qemu_devices(qemu_bin):
        why = f"{qemu_bin} has no virtio-pmem-pci device"
    if why is None:
        return "pmem-dax", None
    if wanted == "pmem-dax":
        raise BackendUnavailable(f"layers on virtio-pmem with DAX: {why}",
                                 hint="set ENVBUILD_VM_LAYERS=virtio-blk (or auto)")
    return "virtio-blk", why

def guest_config(lock: ResolvedLock, *, layers: int, network: bool, nofile: int,
                 pmem: bool = False) -> bytes:
    """The config disk's contents (pure): a shell fragment, padded with newlines to a sector
    multiple so the init sources the device itself."""
    hostname = lock.hostname or "sandbox"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}", hostname):
        raise RuntimeShimError(f"lock hostname {hostname!r} is not a valid host name")
    env = [f"{k}={v}" for k, v in lock.env.items()]
    text = (f"EB_LAYERS={layers}\nEB_PMEM={1 if pmem else 0}\n"
            f"EB_HOSTNAME={shlex.quote(hostname)}\n"
            f"EB_NET={1 if network else 0}\nEB_NOFILE={int(nofile)}\n"
            f"set -- {' '.join(shlex.quote(e) for e in env)}\n").encode()
    if b"\0" in text:
        raise RuntimeShimError("lock env contains a NUL byte")
    if len(text) > CONFIG_DISK_SIZE * 16:
        raise RuntimeShimError(f"lock env is too large for the VM config ({len(text)} bytes)")
    return text + b"\n" * (-len(text) % CONFIG_DISK_SIZE or 0)


def vm_drives(layer_images: Sequence[Path], rw_disk: Path, config_disk: Path, *,
              pmem: bool = False) -> tuple[qemu.Drive, ...]:
    """The disks of a VM in the order QEMU attaches them (pure); with ``pmem`` the layers
    are not disks (``vm_pmem``)."""
    if len(layer_images) > MAX_LAYERS:
        raise RuntimeShimError(f"a microVM takes at most {MAX_LAYERS} layers; this lock has "
                               f"{len(layer_images)}",
                               hint="use the container backend for this lock")
    return (qemu.Drive(str(config_disk), "eb-cfg"),
            *(qemu.Drive(str(p), f"eb-l{i}") for i, p in enumerate(layer_images) if not pmem),
            qemu.Drive(str(rw_disk), "eb-rw", readonly=False))


def vm_pmem(layer_images: Sequence[Path]) -> tuple[qemu.Pmem, ...]:
    """The layers as virtio-pmem devices, bottom first (image lengths are already multiples
    of ``qemu.PMEM_ALIGN``: ``erofs.ensure_erofs``)."""
    return tuple(qemu.Pmem(str(p), p.stat().st_size) for p in layer_images)


def vm_request(*, kernel: Path, initrd: Path, cmdline: str, images: Sequence[Path], rw: Path,
               cfg: Path, agent_socket: Path, qmp_socket: Path, memory_bytes: int,
               options: VmOptions, accel: str, network: bool, pmem: bool, incoming: bool
               ) -> qemu.VmRequest:
    """The QEMU request of one VM: its disks (``vm_drives``), its layers as pmem devices on
    a ``q35`` machine or as disks on a ``microvm``, ``memory_bytes`` of RAM (128 MiB at least);
    ``incoming``: started to load a checkpoint (``-incoming defer``) instead of booting."""
    return qemu.VmRequest(
        kernel=str(kernel), initrd=str(initrd), cmdline=cmdline,
        drives=vm_drives(images, rw, cfg, pmem=pmem),
        agent_socket=str(agent_socket), memory_mib=max(128, memory_bytes >> 20),
        vcpus=options.vcpus, accel=accel, network=network,
        qmp_socket=str(qmp_socket), machine="q35" if pmem else "microvm",
        pmem=vm_pmem(images) if pmem else (), balloon=options.balloon,
        incoming="defer" if incoming else None)


def request_model(request: qemu.VmRequest, lock: ResolvedLock, *, network: bool,
                  qemu_version: str, kernel_version: str, initramfs: str
                  ) -> tuple[dict[str, Any], str]:
    """``(model, digest)``: what a checkpoint of this VM must be restored into
    (``runtime_shim.backends.vm.checkpoint.device_model``)."""
    return ckpt.device_model(
        machine=request.machine, memory_mib=request.memory_mib,
        vcpus=request.vcpus, balloon=request.balloon, network=network,
        layers=tuple(layer.digest for layer in lock.layers),
        pmem_sizes=tuple(p.size for p in request.pmem),
        drives=tuple(d.serial for d in request.drives),
        qemu_version=qemu_version, kernel_version=kernel_version, initramfs=initramfs)


__all__ = ["CONFIG_DISK_SIZE", "LAYER_TRANSPORTS", "MAX_LAYERS", "VM_DISK_UNLIMITED", "VmOptions",
           "choose_layer_transport", "guest_config", "request_model", "vm_drives", "vm_pmem",
           "vm_request"]
