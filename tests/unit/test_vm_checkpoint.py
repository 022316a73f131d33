"""MicroVM checkpoint records and sparse digests (runtime_shim.backends.vm.checkpoint), no QEMU."""

from __future__ import annotations

import os

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.backends.vm import checkpoint as ckpt


def _sparse(path, size, writes):
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in writes:
            f.seek(off)
            f.write(data)


def test_sparse_digest_ignores_how_zeros_are_stored_and_the_copy_matches(tmp_path):
    size = 16 << 20
    _sparse(tmp_path / "a", size, [(1 << 20, b"x" * 5000), (10 << 20, os.urandom(70_000))])
    # the same content with the zeros written out rather than left as holes
    with open(tmp_path / "a", "rb") as f:
        dense = f.read()
    (tmp_path / "b").write_bytes(dense)
    da = ckpt.sparse_copy(tmp_path / "a", tmp_path / "copy")
    assert da == ckpt.sparse_copy(tmp_path / "b", None) == ckpt.sparse_copy(tmp_path / "copy", None)
    assert da.size == size
    assert (tmp_path / "copy").read_bytes() == dense
    assert os.stat(tmp_path / "copy").st_blocks * 512 < 1 << 20  # only the data was written
    _sparse(tmp_path / "c", size, [(1 << 20, b"x" * 5000), (10 << 20, b"y")])
    assert ckpt.sparse_copy(tmp_path / "c", None) != da
    _sparse(tmp_path / "d", size + 4096, [(1 << 20, b"x" * 5000)])
    assert ckpt.sparse_copy(tmp_path / "d", None).size == size + 4096
    with pytest.raises(FileExistsError):  # never overwrites
        ckpt.sparse_copy(tmp_path / "a", tmp_path / "copy")


def test_sparse_copy_does_not_follow_a_symlink(tmp_path):
    (tmp_path / "real").write_bytes(b"secret")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        ckpt.sparse_copy(tmp_path / "link", None)


def _record(**kw) -> ckpt.VmCheckpoint:
    model, digest = ckpt.device_model(machine="q35", memory_mib=256, vcpus=1, balloon=True,
                                      network=False, layers=("sha256:" + "a" * 64,),
                                      pmem_sizes=(2 << 20,), drives=("eb-cfg", "eb-rw"),
                                      qemu_version="QEMU 7.2", kernel_version="6.1",
                                      initramfs="x.cpio")
    files = {ckpt.MEMORY_FILE: ckpt.FileDigest("sha256:" + "1" * 64, 10),
             ckpt.DISK_FILE: ckpt.FileDigest("sha256:" + "2" * 64, 20),
             ckpt.CONFIG_FILE: ckpt.FileDigest("sha256:" + "3" * 64, 30)}
    return ckpt.VmCheckpoint(**{"lock": "sha256:" + "f" * 64, "device_model": digest,
                                "model": model, "files": files, "next_channel": 7,
                                "seconds": 0.5, **kw})


def test_record_round_trips_and_refuses_other_versions_and_garbage():
    rec = _record()
    assert ckpt.VmCheckpoint.from_json(rec.to_json()) == rec
    assert rec.memory_bytes == 10 and rec.disk_bytes == 20
    with pytest.raises(RuntimeShimError, match="version 2"):
        ckpt.VmCheckpoint.from_json(rec.to_json().replace('"version":1', '"version":2'))
    with pytest.raises(RuntimeShimError, match="read microVM checkpoint record"):
        ckpt.VmCheckpoint.from_json(b"[1, 2]")


def test_device_model_digest_covers_every_field():
    _, base = ckpt.device_model(machine="q35", memory_mib=256, vcpus=1, balloon=True,
                                network=False, layers=(), pmem_sizes=(), drives=(),
                                qemu_version="v", kernel_version="k", initramfs="i")
    _, other = ckpt.device_model(machine="q35", memory_mib=512, vcpus=1, balloon=True,
                                 network=False, layers=(), pmem_sizes=(), drives=(),
                                 qemu_version="v", kernel_version="k", initramfs="i")
    assert base != other and base.startswith("sha256:")


def test_check_file_names_the_mismatch():
    rec = _record()
    ckpt.check_file(rec, ckpt.DISK_FILE, ckpt.FileDigest("sha256:" + "2" * 64, 20))
    with pytest.raises(RuntimeShimError, match="memory.img does not match"):
        ckpt.check_file(rec, ckpt.MEMORY_FILE, ckpt.FileDigest("sha256:" + "9" * 64, 10))


def test_packed_sparse_disk_round_trips_and_malformed_ones_are_refused(tmp_path):
    from envbuild.errors import CheckpointRefused

    size = 8 << 20
    _sparse(tmp_path / "disk", size, [(4096, b"a" * 10), (3 << 20, os.urandom(100_000)),
                                      (size - 10, b"z" * 10)])
    want = ckpt.pack_sparse(tmp_path / "disk", tmp_path / "packed")
    assert want == ckpt.sparse_copy(tmp_path / "disk", None)
    assert (tmp_path / "packed").stat().st_size < 400_000
    assert ckpt.unpack_sparse(tmp_path / "packed", tmp_path / "out", want) == want
    assert (tmp_path / "out").read_bytes() == (tmp_path / "disk").read_bytes()
    packed = (tmp_path / "packed").read_bytes()

    def refused(data: bytes, match: str, record=want) -> None:
        (tmp_path / "bad").write_bytes(data)
        (tmp_path / "o").unlink(missing_ok=True)
        with pytest.raises(CheckpointRefused, match=match):
            ckpt.unpack_sparse(tmp_path / "bad", tmp_path / "o", record)

    refused(b"not a packed disk", "no envbuild-sparse header")
    refused(packed[:16] + (2).to_bytes(4, "big") + packed[20:], "version 2")
    refused(packed, "length", ckpt.FileDigest(want.sha256, 1 << 40))  # before any write
    assert not (tmp_path / "o").exists()
    refused(packed[:28] + (3).to_bytes(8, "big") + packed[36:], "a block at 3")
    refused(packed[:-5], "truncated")
    # a block repeated (offsets must ascend)
    first = packed[28:28 + 12 + (64 << 10)]
    refused(packed[:28] + first + first + packed[28 + len(first):], "a block at 0")
