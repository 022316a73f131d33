"""MicroVM checkpoints: a running VM's memory and device state (QEMU migration to a file) and
its writable disk, restored later in a new QEMU that never boots a kernel.

A checkpoint is a directory of three files plus the record that vouches for them::

    memory.img     QEMU's migration stream (RAM, CPU and device state), ``migrate exec:cat``
    rw.ext4.sparse the writable disk at the moment the VM stopped: only its non-zero blocks
                   (``pack_sparse``), so a 10 GiB disk with 2 MB written is a 2 MB file
    config.sh      the config disk (the guest read it at boot; kept byte-identical)

and ``VmCheckpoint`` (``to_record`` / ``from_record``, the ``record`` of the
``runtime_shim.backends.base.CheckpointImage`` of kind ``"qemu"``; ``CHECKPOINT_VERSION``):
the digest and size
of each file, the digest of the VM's device model (``device_model``: machine, RAM, vCPUs,
devices, layer digests and pmem sizes, QEMU's version) and what the agent line needs. The
record is envbuild's own: the caller keeps it where a sandbox cannot write (the store, as a
blob named by its digest, or the node dir) and hands it back to ``restore``. The files are
untrusted input: ``restore`` loads nothing whose digest or device model differs from the
record (a memory image is parsed by QEMU's migration code, which runs unfiltered on the host),
and leaves nothing behind when it refuses.

Digests of sparse files (``sparse_copy``): sha256 over ``(offset, block)`` of every non-zero
``BLOCK``-byte block plus the length, so a hole and a run of zeros hash the same and the
digest does not depend on how a filesystem stored the file. The copy writes only those
blocks into a file truncated to the length: a 10 GiB disk with 2 MB written costs 2 MB.

Consistency (``MicroVmSandbox.checkpoint``): the guest freezes its writable ext4 (as for
pack-diff), QMP ``stop`` halts the vCPUs and drains the disk queue, the migration writes the
memory image, the disk is copied, then the original either resumes (``leave_running``: QMP
``cont`` + unfreeze) or is closed. The image is of a frozen guest, so the restored VM's first
act is the unfreeze.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from envbuild.errors import CheckpointRefused, RuntimeShimError
from runtime_shim.isolation.scratchfs import data_extents

CHECKPOINT_VERSION = 1
MEMORY_FILE = "memory.img"
DISK_FILE = "rw.ext4.sparse"  # the disk's non-zero blocks (pack_sparse)
CONFIG_FILE = "config.sh"
RECORD_FILE = "checkpoint.json"
BLOCK = 64 << 10
_ZERO = bytes(BLOCK)


@dataclasses.dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int


@dataclasses.dataclass(frozen=True)
class VmCheckpoint:
    """envbuild's record of one microVM checkpoint (see the module docstring)."""

    lock: str  # the lock digest the VM ran
    device_model: str  # sha256 of device_model(request, layers)
    model: dict  # the device model itself (for messages and restore)
    files: dict[str, FileDigest]
    next_channel: int  # the agent line's next channel id (ids are not reused)
    seconds: float = 0.0  # how long the checkpoint took
    version: int = CHECKPOINT_VERSION

    @property
    def memory_bytes(self) -> int:
        return self.files[MEMORY_FILE].size

    @property
    def disk_bytes(self) -> int:
        return self.files[DISK_FILE].size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def to_record(self) -> dict:
        """The JSON-able form (``runtime_shim.backends.base.CheckpointImage.record``)."""
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, text: str | bytes) -> VmCheckpoint:
        try:
            return cls.from_record(json.loads(text))
        except ValueError as e:
            raise RuntimeShimError(f"read microVM checkpoint record: {e}") from None

    @classmethod
    def from_record(cls, raw) -> VmCheckpoint:
        try:
            if raw.get("version") != CHECKPOINT_VERSION:
                raise RuntimeShimError(f"microVM checkpoint record version {raw.get('version')!r}"
                                       f" is not {CHECKPOINT_VERSION}",
                                       hint="make the checkpoint again with this envbuild")
            files = {k: FileDigest(str(v["sha256"]), int(v["size"]))
                     for k, v in raw["files"].items()}
            return cls(lock=str(raw["lock"]), device_model=str(raw["device_model"]),
                       model=dict(raw["model"]), files=files,
                       next_channel=int(raw["next_channel"]), seconds=float(raw["seconds"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RuntimeShimError(f"read microVM checkpoint record: {e}") from None


def device_model(*, machine: str, memory_mib: int, vcpus: int, balloon: bool, network: bool,
                 layers: tuple[str, ...], pmem_sizes: tuple[int, ...], drives: tuple[str, ...],
                 qemu_version: str, kernel_version: str, initramfs: str) -> tuple[dict, str]:
    """The VM's device model (pure): everything a migration stream depends on, and its
    digest. Paths are not in it (a restore runs under another sandbox dir)."""
    model = {"machine": machine, "memory_mib": memory_mib, "vcpus": vcpus, "balloon": balloon,
             "network": network, "layers": list(layers), "pmem_sizes": list(pmem_sizes),
             "drives": list(drives), "qemu": qemu_version, "kernel": kernel_version,
             "initramfs": initramfs}
    text = json.dumps(["envbuild.vm.device-model.v1", model], sort_keys=True,
                      separators=(",", ":"))
    return model, "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def sparse_copy(src: Path, dst: Path | None) -> FileDigest:
    """The sparse digest of ``src`` (module docstring); with ``dst``, also a copy holding
    only its non-zero blocks (``dst`` is created, never overwritten). Reads only the data
    regions (``SEEK_DATA``/``SEEK_HOLE``)."""
    h = hashlib.sha256(b"envbuild.sparse.v1\0")
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    out = -1
    try:
        size = os.fstat(fd).st_size
        if dst is not None:
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.ftruncate(out, size)
        for off, block in _blocks(fd, size):
            h.update(off.to_bytes(8, "big") + len(block).to_bytes(4, "big"))
            h.update(block)
            if out >= 0:
                os.pwrite(out, block, off)
        h.update(b"end" + size.to_bytes(8, "big"))
    finally:
        os.close(fd)
        if out >= 0:
            os.close(out)
    return FileDigest("sha256:" + h.hexdigest(), size)


SPARSE_MAGIC = b"envbuild-sparse\0"
SPARSE_VERSION = 1
_HEADER = len(SPARSE_MAGIC) + 4 + 8
_RECORD = 8 + 4


def pack_sparse(src: Path, dst: Path) -> FileDigest:
    """Write the non-zero ``BLOCK``-aligned blocks of ``src`` to the new file ``dst``:
    ``SPARSE_MAGIC``, version u32, length u64, then ``offset u64, length u32, bytes`` per
    block in ascending order. Returns the sparse digest of ``src`` (``sparse_copy``)."""
    with open(dst, "xb") as out:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            out.write(SPARSE_MAGIC + SPARSE_VERSION.to_bytes(4, "big") + size.to_bytes(8, "big"))
            h = hashlib.sha256(b"envbuild.sparse.v1\0")
            for off, block in _blocks(fd, size):
                head = off.to_bytes(8, "big") + len(block).to_bytes(4, "big")
                h.update(head)
                h.update(block)
                out.write(head)
                out.write(block)
            h.update(b"end" + size.to_bytes(8, "big"))
        finally:
            os.close(fd)
    return FileDigest("sha256:" + h.hexdigest(), size)


def unpack_sparse(src: Path, dst: Path, want: FileDigest) -> FileDigest:
    """Expand a ``pack_sparse`` file (untrusted) into the new sparse file ``dst`` and return
    the digest of what was written. Bounded: the length must be ``want.size`` (checked before
    anything is written), blocks ``BLOCK``-aligned, whole, ascending and inside it; anything
    else is ``CheckpointRefused``."""
    def bad(why: str) -> CheckpointRefused:
        return CheckpointRefused(f"restore microVM checkpoint: {DISK_FILE} is malformed: {why}",
                                 hint="the checkpoint's files were changed; make a new one")

    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    out = -1
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            head = f.read(_HEADER)
            if len(head) != _HEADER or not head.startswith(SPARSE_MAGIC):
                raise bad("no envbuild-sparse header")
            version = int.from_bytes(head[len(SPARSE_MAGIC):len(SPARSE_MAGIC) + 4], "big")
            if version != SPARSE_VERSION:
                raise bad(f"version {version}, not {SPARSE_VERSION}")
            size = int.from_bytes(head[-8:], "big")
            if size != want.size:
                raise bad(f"length {size}, the record says {want.size}")
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.ftruncate(out, size)
            h = hashlib.sha256(b"envbuild.sparse.v1\0")
            next_off = 0
            while rec := f.read(_RECORD):
                if len(rec) != _RECORD:
                    raise bad("a truncated block header")
                off, n = int.from_bytes(rec[:8], "big"), int.from_bytes(rec[8:], "big")
                if off % BLOCK or off < next_off or off >= size or n != min(BLOCK, size - off):
                    raise bad(f"a block at {off} of {n} bytes")
                block = f.read(n)
                if len(block) != n:
                    raise bad("a truncated block")
                if block != _ZERO[:n]:
                    h.update(rec)
                    h.update(block)
                    os.pwrite(out, block, off)
                next_off = off + n
            h.update(b"end" + size.to_bytes(8, "big"))
    finally:
        os.close(fd)
        if out >= 0:
            os.close(out)
    return FileDigest("sha256:" + h.hexdigest(), size)


def _blocks(fd: int, size: int):
    """``(offset, bytes)`` of each non-zero ``BLOCK``-aligned block, reading only the data
    regions (``SEEK_DATA``/``SEEK_HOLE``)."""
    pos = 0
    for start, end in data_extents(fd, size):
        off = max(start - start % BLOCK, pos)
        while off < end:
            block = os.pread(fd, min(BLOCK, size - off), off)
            if not block:
                return
            if block != _ZERO[:len(block)]:
                yield off, block
            off += len(block)
        pos = off


def file_digest(path: Path) -> FileDigest:
    """sha256 of a whole file (the memory image: dense, read once)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = 0
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            buf = bytearray(4 << 20)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
    finally:
        os.close(fd)
    return FileDigest("sha256:" + h.hexdigest(), size)


def check_file(record: VmCheckpoint, name: str, got: FileDigest) -> None:
    want = record.files.get(name)
    if want is None or want != got:
        raise CheckpointRefused(f"restore microVM checkpoint: {name} does not match the "
                               f"checkpoint's record",
                               context=f"recorded {want}, found {got}",
                               hint="the checkpoint files were changed or belong to another "
                                    "checkpoint; make a new checkpoint")


def checked_copy(record: VmCheckpoint, src_dir: Path, name: str, dst: Path | None) -> None:
    """Check checkpoint file ``name`` of ``src_dir`` against ``record`` (copying it to
    ``dst`` while at it, ``sparse_copy``; whole-file sha256 for the memory image):
    ``CheckpointRefused`` when it differs or cannot be read as a regular file (a symlink is
    never followed)."""
    path = src_dir / name
    try:
        if name == MEMORY_FILE:
            got = file_digest(path)
        elif name == DISK_FILE and dst is not None:
            want = record.files.get(name)
            if want is None:
                raise CheckpointRefused(f"restore microVM checkpoint: the record has no {name}")
            got = unpack_sparse(path, dst, want)
        else:
            got = sparse_copy(path, dst)
    except OSError as e:
        raise CheckpointRefused(f"restore microVM checkpoint: read {name}: "
                                f"{e.strerror or e}",
                                hint="the checkpoint's files are incomplete or were replaced; "
                                     "make a new checkpoint") from None
    check_file(record, name, got)
