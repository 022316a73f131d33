"""The microVM backend's pure parts: QEMU argv, kernel command line, guest config, disks."""

from __future__ import annotations

import dataclasses

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.backends.vm.backend import MAX_LAYERS, guest_config, vm_drives
from runtime_shim.backends.vm.kernel import host_tsc_khz, kernel_cmdline
from runtime_shim.backends.vm.qemu import Drive, VmRequest, qemu_argv
from runtime_shim.node.locks import ResolvedLock


def _request(**kw) -> VmRequest:
    base = VmRequest(kernel="/k/vmlinux", initrd="/c/init.cpio", cmdline="console=ttyS0",
                     drives=(Drive("/n/cfg", "eb-cfg"), Drive("/n/l0.erofs", "eb-l0"),
                             Drive("/s/rw.ext4", "eb-rw", readonly=False)),
                     agent_socket="/s/agent.sock")
    return dataclasses.replace(base, **kw)


def _opt_after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_tcg_argv_is_microvm_without_defaults_or_network():
    argv = qemu_argv(_request())
    assert argv[:5] == ["qemu-system-x86_64", "-M", "microvm", "-accel", "tcg"]
    assert "-cpu" not in argv  # TCG keeps QEMU's default model
    for flag in ("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"):
        assert flag in argv
    assert _opt_after(argv, "-kernel") == ["/k/vmlinux"]
    assert _opt_after(argv, "-initrd") == ["/c/init.cpio"]
    assert not any("netdev" in a or "virtio-net" in a for a in argv)


def test_kvm_argv_uses_the_host_cpu():
    argv = qemu_argv(_request(accel="kvm"))
    assert _opt_after(argv, "-accel") == ["kvm"]
    assert _opt_after(argv, "-cpu") == ["host"]


def test_unknown_accel_is_refused():
    with pytest.raises(ValueError):
        qemu_argv(_request(accel="hvf"))


def test_limits_become_memory_and_cpus():
    argv = qemu_argv(_request(memory_mib=768, vcpus=2))
    assert _opt_after(argv, "-m") == ["768M"]
    assert _opt_after(argv, "-smp") == ["2"]


def test_network_adds_one_user_mode_nic():
    argv = qemu_argv(_request(network=True))
    assert _opt_after(argv, "-netdev") == ["user,id=n0,ipv6=off"]
    assert "virtio-net-device,netdev=n0" in _opt_after(argv, "-device")
    assert argv[0] != "nsenter"


def test_network_namespace_wraps_qemu_in_nsenter():
    argv = qemu_argv(_request(network=True, network_ns="/n/sandboxes/eb-1/netns"))
    assert argv[:3] == ["nsenter", "--net=/n/sandboxes/eb-1/netns", "--"]
    assert argv[3] == _request().qemu


def test_drives_keep_order_serials_and_read_only():
    argv = qemu_argv(_request())
    drives = _opt_after(argv, "-drive")
    assert [d.split(",")[0] for d in drives] == ["file=/n/cfg", "file=/n/l0.erofs",
                                                 "file=/s/rw.ext4"]
    assert "readonly=on" in drives[1] and "readonly=on" not in drives[2]
    devices = [d for d in _opt_after(argv, "-device") if d.startswith("virtio-blk")]
    assert [d.rsplit("serial=", 1)[1] for d in devices] == ["eb-cfg", "eb-l0", "eb-rw"]


def test_agent_port_is_a_named_virtserialport_on_a_socket():
    argv = qemu_argv(_request())
    assert "socket,path=/s/agent.sock,server=on,wait=off,id=agent" in _opt_after(argv, "-chardev")
    assert "virtserialport,chardev=agent,name=envbuild.agent" in _opt_after(argv, "-device")


def test_commas_in_paths_are_escaped():
    argv = qemu_argv(_request(agent_socket="/a,b/agent.sock"))
    assert any(a.startswith("socket,path=/a,,b/agent.sock,") for a in argv)


def test_cmdline_carries_the_host_tsc_rate():
    line = kernel_cmdline(tsc_khz=2596148)
    assert "tsc_early_khz=2596148" in line.split()
    assert "console=ttyS0" in line.split()
    assert host_tsc_khz("model name\t: X\ncpu MHz\t\t: 2596.148\n") == 2596148
    assert host_tsc_khz("no such line") == 2_000_000


def _lock(env=None, hostname=None) -> ResolvedLock:
    return ResolvedLock(digest="sha256:" + "0" * 64, layers=(), env=env or {}, workdir="/w",
                        user="1000:1000", cmd=None, hostname=hostname, manifest={}, config={})


def test_guest_config_is_quoted_shell_padded_to_sectors():
    cfg = guest_config(_lock({"PATH": "/usr/bin:/bin", "Q": "it's $HOME `x`"}, "box-1"),
                       layers=3, network=False, nofile=1024)
    assert len(cfg) % 4096 == 0
    assert b"\0" not in cfg  # newline-padded: the init sources the device itself
    text = cfg.decode()
    assert "EB_LAYERS=3\n" in text and "EB_NET=0\n" in text and "EB_HOSTNAME=box-1\n" in text
    assert "set -- PATH=/usr/bin:/bin 'Q=it'\"'\"'s $HOME `x`'" in text


def test_guest_config_refuses_a_bad_hostname():
    with pytest.raises(RuntimeShimError):
        guest_config(_lock(hostname="a b; reboot"), layers=1, network=False, nofile=1)


def test_drives_order_and_layer_limit(tmp_path):
    drives = vm_drives([tmp_path / "a", tmp_path / "b"], tmp_path / "rw", tmp_path / "cfg")
    assert [d.serial for d in drives] == ["eb-cfg", "eb-l0", "eb-l1", "eb-rw"]
    assert [d.readonly for d in drives] == [True, True, True, False]
    with pytest.raises(RuntimeShimError, match="at most"):
        vm_drives([tmp_path / "x"] * (MAX_LAYERS + 1), tmp_path / "rw", tmp_path / "cfg")


def test_pmem_layers_need_q35_and_get_fixed_slots_before_any_other_device():
    from runtime_shim.backends.vm.qemu import PMEM_FIRST_SLOT, Pmem

    with pytest.raises(ValueError, match="q35"):
        qemu_argv(_request(pmem=(Pmem("/n/l0.erofs", 2 << 20),)))
    with pytest.raises(ValueError, match="multiple"):
        qemu_argv(_request(machine="q35", pmem=(Pmem("/n/l0.erofs", 3 << 20),)))
    argv = qemu_argv(_request(machine="q35", memory_mib=256, drives=_request().drives[::2],
                              pmem=(Pmem("/n/l0.erofs", 2 << 20), Pmem("/n/l,1.erofs", 4 << 20))))
    assert argv[1:5] == ["-M", "q35,hpet=off,smbus=off,sata=off,vmport=off", "-bios",
                         "qboot.rom"]
    # device memory above the RAM holds both images
    assert _opt_after(argv, "-m") == ["256M,slots=2,maxmem=262M"]
    objects = _opt_after(argv, "-object")
    assert objects == ["memory-backend-file,id=pm0,share=on,readonly=on,mem-path=/n/l0.erofs,"
                       f"size={2 << 20}",
                       "memory-backend-file,id=pm1,share=on,readonly=on,mem-path=/n/l,,1.erofs,"
                       f"size={4 << 20}"]
    devices = _opt_after(argv, "-device")
    assert devices[:2] == [f"virtio-pmem-pci,memdev=pm0,id=pmem0,addr={PMEM_FIRST_SLOT:#04x}",
                           f"virtio-pmem-pci,memdev=pm1,id=pmem1,addr={PMEM_FIRST_SLOT + 1:#04x}"]
    # the rest are PCI devices too (q35 has no virtio-mmio)
    assert not any(d.endswith("-device") or "-device," in d for d in devices)
    assert any(d.startswith("virtio-blk-pci,") for d in devices)
    assert "virtio-serial-pci" in devices


def test_balloon_and_incoming():
    argv = qemu_argv(_request(balloon=True, incoming="defer"))
    assert "virtio-balloon-device,id=balloon0,free-page-reporting=on" in argv
    assert argv[-2:] == ["-incoming", "defer"]
    assert not any("balloon" in a for a in qemu_argv(_request()))


def test_guest_config_says_whether_layers_are_pmem():
    lock = _lock()
    assert b"EB_PMEM=1\n" in guest_config(lock, layers=2, network=False, nofile=64, pmem=True)
    assert b"EB_PMEM=0\n" in guest_config(lock, layers=2, network=False, nofile=64)


def test_pmem_dax_needs_dax_in_the_kernel_config(tmp_path):
    from runtime_shim.backends.vm.kernel import GuestKernel, pmem_dax_missing

    mods = tmp_path / "modules"
    mods.mkdir()
    (mods / "modules.dep").write_text(
        "kernel/drivers/virtio/virtio_pci.ko:\nkernel/drivers/nvdimm/virtio_pmem.ko:\n"
        "kernel/drivers/nvdimm/nd_pmem.ko:\n")
    (tmp_path / "vmlinuz-6.1.0-1-cloud-amd64").write_bytes(b"")
    kern = GuestKernel(tmp_path / "vmlinuz-6.1.0-1-cloud-amd64", "6.1.0-1-cloud-amd64", mods)
    assert "no config" in pmem_dax_missing(kern)
    good = ("CONFIG_FS_DAX=y\nCONFIG_VIRTIO_PMEM=m\nCONFIG_LIBNVDIMM=m\nCONFIG_BLK_DEV_PMEM=m\n"
            "CONFIG_VIRTIO_PCI=m\nCONFIG_ZONE_DEVICE=y\n")
    config = tmp_path / "config-6.1.0-1-cloud-amd64"
    config.write_text(good)
    assert pmem_dax_missing(kern) is None
    config.write_text(good.replace("CONFIG_FS_DAX=y", "# CONFIG_FS_DAX is not set"))
    assert pmem_dax_missing(kern) == "the guest kernel lacks CONFIG_FS_DAX"
    config.write_text(good)
    (mods / "modules.dep").write_text("kernel/drivers/virtio/virtio_pci.ko:\n")
    assert "virtio_pmem" in pmem_dax_missing(kern)
