"""The guest initramfs: reproducible bytes, the entries the init relies on, module order."""

from __future__ import annotations

import stat

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.backends.vm.initramfs import CpioEntry, initramfs_entries, newc_archive
from runtime_shim.backends.vm.kernel import extract_vmlinux, module_load_order, module_name

MODULES_DEP = """\
kernel/fs/erofs/erofs.ko.xz: kernel/lib/libcrc32c.ko.xz
kernel/lib/libcrc32c.ko.xz:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/fs/overlayfs/overlay.ko:
"""


def _entries(**kw):
    args = dict(busybox=b"\x7fELF busybox", modules=[("virtio_ring.ko", b"r"),
                                                      ("virtio.ko", b"v")], agent=b"agent",
                kernel_version="6.1.0-9-cloud-amd64")
    args.update(kw)
    return initramfs_entries(**args)


def test_same_inputs_same_bytes():
    assert newc_archive(_entries()) == newc_archive(_entries())
    assert newc_archive(_entries()) != newc_archive(_entries(agent=b"other agent"))


def test_archive_is_newc_sorted_and_padded():
    entries = _entries()
    assert [e.name for e in entries] == sorted(e.name for e in entries)
    data = newc_archive(entries)
    assert data.startswith(b"070701") and len(data) % 512 == 0
    assert b"TRAILER!!!\0" in data
    # mtime field (8th) is 0 for every entry: reproducible whatever the clock
    pos = 0
    while True:
        header = data[pos:pos + 110]
        mtime = int(header[6 + 8 * 5:6 + 8 * 6], 16)
        namesize = int(header[6 + 8 * 11:6 + 8 * 12], 16)
        filesize = int(header[6 + 8 * 6:6 + 8 * 7], 16)
        name = data[pos + 110:pos + 110 + namesize - 1]
        assert mtime == 0, name
        if name == b"TRAILER!!!":
            break
        pos += 110 + namesize
        pos += -pos % 4
        pos += filesize
        pos += -pos % 4


def test_entries_the_init_relies_on():
    by_name = {e.name: e for e in _entries()}
    assert by_name["init"].mode & 0o111 and by_name["init"].data.startswith(b"#!/bin/busybox sh")
    # busybox and the agent live in /.envbuild (root only), bind-mounted into the new root
    assert by_name[".envbuild/busybox"].data == b"\x7fELF busybox"
    assert by_name[".envbuild/agent"].data == b"agent"
    assert stat.S_IMODE(by_name[".envbuild"].mode) == 0o700
    assert stat.S_ISLNK(by_name["bin/busybox"].mode)
    assert by_name["bin/busybox"].data == b"/.envbuild/busybox"
    assert stat.S_ISCHR(by_name["dev/console"].mode) and by_name["dev/console"].rdev == (5, 1)
    # modprobe -a $mods: names on one line, in load order, each in modules.dep
    assert by_name["etc/modules"].data == b"virtio_ring virtio\n"
    mod_dir = "lib/modules/6.1.0-9-cloud-amd64"
    assert by_name[f"{mod_dir}/modules.dep"].data == b"virtio_ring.ko:\nvirtio.ko:\n"
    assert by_name[f"{mod_dir}/virtio.ko"].data == b"v"
    assert b"/dev devtmpfs" in by_name["etc/fstab.boot"].data
    for d in ("newroot", "proc", "sys", "rw", ".envbuild/rw", "layers/0", "layers/20"):
        assert stat.S_ISDIR(by_name[d].mode), d


def test_modules_need_the_kernel_version():
    with pytest.raises(ValueError):
        _entries(kernel_version="")
    assert "etc/modules" in {e.name for e in _entries(modules=[], kernel_version="")}


def test_duplicate_module_names_are_refused():
    with pytest.raises(RuntimeShimError):
        _entries(modules=[("a.ko", b"1"), ("a.ko", b"2")])


def test_newc_of_a_device_node_keeps_rdev():
    data = newc_archive([CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))])
    header = data[:110]
    assert int(header[6 + 8 * 9:6 + 8 * 10], 16) == 5 and int(header[6 + 8 * 10:6 + 8 * 11], 16) == 1


def test_modules_load_after_their_dependencies():
    order = module_load_order(MODULES_DEP, ["virtio_mmio", "virtio_blk", "erofs", "overlay",
                                            "ext4"], builtin=["kernel/fs/ext4/ext4.ko"])
    names = [module_name(p) for p in order]
    assert names == ["virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "libcrc32c", "erofs",
                     "overlay"]
    assert order[names.index("erofs")] == "kernel/fs/erofs/erofs.ko.xz"


def test_unknown_module_is_an_error():
    with pytest.raises(RuntimeShimError, match="9p"):
        module_load_order(MODULES_DEP, ["9p"])


def test_extract_vmlinux_finds_a_gzip_payload():
    import gzip

    elf = b"\x7fELF" + b"kernel" * 100
    bz = b"MZ setup code \x1f\x8b\x08 false magic" + gzip.compress(elf, mtime=0) + b"trailer"
    assert extract_vmlinux(bz) == elf
    assert extract_vmlinux(b"no payload here") is None


def test_strip_signature_drops_the_appended_pkcs7_block():
    from runtime_shim.backends.vm.kernel import MODULE_SIG_MAGIC, strip_signature

    body = b"\x7fELF module body"
    sig = b"S" * 37
    signed = body + sig + bytes(8) + len(sig).to_bytes(4, "big") + MODULE_SIG_MAGIC
    assert strip_signature(signed) == body
    assert strip_signature(body) == body  # unsigned: unchanged
