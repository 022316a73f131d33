"""The microVM backend's pure parts: QEMU argv, kernel command line, guest config, disks."""

from __future__ import annotations

import dataclasses

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.locks import ResolvedLock
from runtime_shim.vm.backend import MAX_LAYERS, guest_config, vm_drives
from runtime_shim.vm.kernel import host_tsc_khz, kernel_cmdline
from runtime_shim.vm.qemu import Drive, VmRequest, qemu_argv


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
