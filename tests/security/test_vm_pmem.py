"""Attacks on the shared layer images of microVMs (issue 19, item 1): with ``pmem-dax`` every
VM maps the node's EROFS image of a layer, so a guest root writing to its pmem device must
change neither the host file nor what another VM reads. QEMU maps the image read-only
(``memory-backend-file,readonly=on``): the guest's writes are dropped. Real QEMU (TCG).
"""

from __future__ import annotations

import hashlib

import pytest

from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.integration.test_microvm import _require_vm_tools

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_guest_root_writing_its_pmem_layer_changes_no_host_image(busybox_store, monkeypatch):
    _require_vm_tools()
    store, node = busybox_store
    monkeypatch.setenv("ENVBUILD_VM_LAYERS", "pmem-dax")
    # 2 GiB disks: admission reserves each VM's disk whole, and CI's node refused a second 10 GiB
    limits = Limits(memory_bytes=256 << 20, disk_bytes=2 << 30)
    with Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=limits) as a, \
            Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                           limits=limits) as b:
        assert a.info().layer_transport == b.info().layer_transport == "pmem-dax"
        images = [p.path for p in a.handle.request.pmem]
        before = {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in images}
        want = b.exec("md5sum /bin/busybox").stdout
        # guest root scribbles over the start of every layer device, raw
        r = a.exec("for d in /dev/pmem*; do "
                   "/.envbuild/busybox dd if=/dev/urandom of=$d bs=4096 count=64 conv=fsync; "
                   "done 2>&1; echo done", user="0:0", timeout=120)
        assert r.stdout.count(b"64+0 records out") == len(images), r.stdout  # it did write
        after = {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in images}
        assert after == before
        # the other VM reads the same bytes (drop its caches: DAX reads the device itself)
        assert b.exec("echo 3 > /proc/sys/vm/drop_caches; md5sum /bin/busybox",
                      user="0:0").stdout == want
