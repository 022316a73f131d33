"""MicroVM layers on virtio-pmem with DAX (issue 19, item 1), against real QEMU (TCG here).

A small env (busybox-tiny + a workspace of incompressible files at /data) is booted once with
its layers on virtio-pmem (``pmem-dax``: the q35 machine, EROFS mounted ``-o dax``) and once on
virtio-blk (microvm); both must show the same files, and only the DAX guest must read them
without filling its own page cache (its reads are served from the host's page cache of the
image). A guest kernel without DAX (its config file says so) falls back to virtio-blk under
``auto`` and says why in ``info()``; asking for ``pmem-dax`` then fails before anything starts.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from envbuild.errors import BackendUnavailable
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.data_env import build_data_env
from tests.integration.test_microvm import _qemu_pids, _require_vm_tools

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA_FILES = 6
DATA_FILE_BYTES = 2 << 20
# several VMs at once: admission reserves each disk whole, so 2 GiB each, not the default 10
LIMITS = Limits(memory_bytes=256 << 20, disk_bytes=2 << 30)

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    _require_vm_tools()
    return build_data_env(tmp_path_factory.mktemp("vm-pmem"), "pmem-env", DATA_FILES,
                          DATA_FILE_BYTES)


def _vm(built, monkeypatch, transport: str) -> Sandbox:
    store, node, _ = built
    monkeypatch.setenv("ENVBUILD_VM_LAYERS", transport)
    return Sandbox.create("pmem-env", store=store, node_dir=node, backend="microvm",
                          limits=LIMITS)


def _guest_cached_kb(sb: Sandbox) -> int:
    r = sb.exec("sync; awk '/^Cached:/ {print $2}' /proc/meminfo")
    assert r.ok, r.stderr
    return int(r.stdout)


def _sha256s(sb: Sandbox) -> dict:
    r = sb.exec("cd /data && sha256sum f*.bin", timeout=120)
    assert r.ok, r.stderr
    return {name: digest for digest, name in (line.split() for line in
                                              r.stdout.decode().splitlines())}


@pytest.mark.parametrize("transport", ["pmem-dax", "virtio-blk"])
def test_layers_read_the_same_and_only_dax_skips_the_guest_page_cache(built, monkeypatch,
                                                                        transport):
    _, node, digests = built
    data_bytes = DATA_FILES * DATA_FILE_BYTES
    with _vm(built, monkeypatch, transport) as sb:
        assert sb.info().layer_transport == transport
        blocks = sb.exec("ls /sys/block").stdout.split()
        pmem = sorted(b for b in blocks if b.startswith(b"pmem"))
        # three layers: busybox-tiny, its config step, the data workspace
        assert len(pmem) == (len(sb.lock.layers) if transport == "pmem-dax" else 0)
        if transport == "pmem-dax":
            assert sb.handle.request.machine == "q35"
            dmesg = sb.exec("dmesg").stdout
            assert dmesg.count(b"erofs: (device pmem") == len(sb.lock.layers)
        before = _guest_cached_kb(sb)
        assert _sha256s(sb) == digests  # the same bytes as the host's files, both ways
        grown = (_guest_cached_kb(sb) - before) << 10
        if transport == "pmem-dax":
            assert grown < data_bytes // 4, f"the DAX guest cached {grown} bytes of its reads"
        else:
            assert grown >= data_bytes * 9 // 10, f"virtio-blk guest cached only {grown} bytes"
        # the host's page cache holds the image the guests read (one copy, shared)
        images = list((node / "node" / "erofs").glob("*.erofs"))
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                              *map(str, images)], capture_output=True, text=True, check=True)
        assert sum(int(x) for x in out.stdout.split()) >= data_bytes * 9 // 10
        # the image files are whole multiples of the pmem alignment, content untouched
        assert all(p.stat().st_size % (2 << 20) == 0 for p in images)
        pid = sb.host_pid
    assert pid not in _qemu_pids()
    assert mounted_targets_under(str(node)) == []


def _kernel_without_dax(tmp_path: Path) -> Path:
    """The host's guest kernel, copied beside a config that lacks CONFIG_FS_DAX (its modules
    stay in /lib/modules/<version>: find_kernel looks them up by version)."""
    from runtime_shim.backends.vm.kernel import find_kernel

    kern = find_kernel({})
    boot = tmp_path / "boot"
    boot.mkdir()
    shutil.copy2(kern.path, boot / kern.path.name)
    config = (kern.path.parent / f"config-{kern.version}").read_text()
    (boot / f"config-{kern.version}").write_text(
        config.replace("CONFIG_FS_DAX=y", "# CONFIG_FS_DAX is not set"))
    return boot / kern.path.name


def test_a_kernel_without_dax_falls_back_to_virtio_blk_and_says_so(built, monkeypatch,
                                                                    tmp_path):
    store, node, digests = built
    monkeypatch.setenv("ENVBUILD_VM_KERNEL", str(_kernel_without_dax(tmp_path)))
    with _vm(built, monkeypatch, "auto") as sb:
        assert sb.info().layer_transport == "virtio-blk"
        assert sb.handle.describe()["layer_transport_why"] == \
            "the guest kernel lacks CONFIG_FS_DAX"
        assert sb.handle.request.machine == "microvm"
        assert _sha256s(sb) == digests
    before = set((node / "sandboxes").iterdir())
    with pytest.raises(BackendUnavailable, match="CONFIG_FS_DAX"):
        _vm(built, monkeypatch, "pmem-dax")
    assert set((node / "sandboxes").iterdir()) == before  # nothing made, nothing left
