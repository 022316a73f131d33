"""The node budget's arithmetic (``runtime_shim.node.admission``, pure parts) and the default
limits it relies on (issue 34, items 3, 7 and 8)."""

from __future__ import annotations

import pytest

from envbuild.errors import AdmissionRefused, SettingsError
from runtime_shim.node.admission import (
    BudgetSettings,
    HostTables,
    Reservation,
    fit,
    node_budget,
    parse_caps,
    refusal,
    reservation,
    vm_reservation,
)
from runtime_shim.node.model import Limits, default_cpus

GiB = 1 << 30
# This CI host's tables (fs.file-max of a 23 GiB machine), its 252 GiB disk with 79 GiB free
HOST = HostTables(file_max=2_466_290, pid_max=32768, threads_max=192_739,
                  disk_free=79 * GiB, disk_size=252 * GiB)


def test_budget_keeps_a_share_of_each_table_for_the_host():
    b = node_budget(HOST, BudgetSettings())
    assert b.limits == Reservation(files=int(2_466_290 * 0.75), tasks=24576,
                                   disk_bytes=79 * GiB - int(252 * GiB * 0.05))
    assert b.sources["files"] == "75% of fs.file-max 2466290"
    assert b.sources["tasks"] == "75% of kernel.pid_max 32768"  # the smaller of the two
    low_threads = HostTables(2_466_290, 4_194_304, 10_000, 0, 0)
    assert node_budget(low_threads, BudgetSettings()).sources["tasks"] == \
        "75% of kernel.threads-max 10000"
    assert node_budget(low_threads, BudgetSettings()).limits.disk_bytes == 0


def test_explicit_caps_only_lower_the_budget():
    b = node_budget(HOST, BudgetSettings(caps={"files": 1000, "disk_bytes": 10 ** 15}))
    assert b.limits.files == 1000 and b.sources["files"] == "ENVBUILD_NODE_BUDGET files=1000"
    assert b.limits.disk_bytes < 10 ** 15 and "free" in b.sources["disk_bytes"]


def test_the_observed_attack_no_longer_fits():
    """Two sandboxes of 505 processes x 4,090 files filled fs.file-max: at the old defaults
    (512 x 4096) not even one fits three quarters of it; at the new ones, seven do, and the
    sum of what the admitted ones can open stays below the budget."""
    budget = node_budget(HOST, BudgetSettings())
    old = reservation(Limits(pids=512, nofile=4096))
    assert refusal(budget, Reservation(), 0, old, "sandbox a") is not None
    one = reservation(Limits())
    assert one == Reservation(files=256 * 1024, tasks=256, disk_bytes=10 * GiB)
    held, admitted = Reservation(), 0
    while refusal(budget, held, admitted, one, "sandbox") is None:
        held, admitted = held + one, admitted + 1
    assert admitted == 6  # the disk (79 GiB free less 5% of 252 GiB kept free) binds first
    assert held.files <= budget.limits.files and held.disk_bytes <= budget.limits.disk_bytes


def test_refusal_names_the_budget_in_one_line():
    budget = node_budget(HOST, BudgetSettings(caps={"tasks": 600}))
    line = refusal(budget, Reservation(tasks=512), 2, Reservation(tasks=256), "sandbox eb-1")
    assert line == ("tasks", "node budget of tasks exceeded: sandbox eb-1 needs 256, 512 "
                    "reserved by 2 other(s), budget 600 (ENVBUILD_NODE_BUDGET tasks=600)")
    line = refusal(budget, Reservation(), 0, Reservation(disk_bytes=100 * GiB), "the build of x")
    assert line is not None and line[0] == "disk_bytes" and "\n" not in line[1]
    assert "needs 100.0 GiB" in line[1] and "kept free" in line[1]


def test_a_build_disk_is_lowered_to_what_is_left_not_below_its_minimum():
    budget = node_budget(HostTables(10 ** 9, 32768, 32768, 60 * GiB, 100 * GiB),
                         BudgetSettings())  # 55 GiB of disk
    want = Reservation(disk_bytes=50 * GiB)
    assert fit(budget, Reservation(), want, GiB) == want
    assert fit(budget, Reservation(disk_bytes=50 * GiB), want, GiB) == Reservation(
        disk_bytes=5 * GiB)
    assert fit(budget, Reservation(disk_bytes=54 * GiB + 1), want, GiB) == want  # < 1 GiB left
    assert fit(budget, Reservation(disk_bytes=50 * GiB), want, None) == want  # a sandbox's


def test_unbounded_limits_are_refused_not_counted_as_zero():
    with pytest.raises(AdmissionRefused, match=r"Limits.pids=None.*process and file tables"):
        reservation(Limits(pids=None))
    with pytest.raises(AdmissionRefused, match=r"Limits.memory_bytes=None.*kernel memory"):
        reservation(Limits(memory_bytes=None))
    # a microVM's processes live in its guest: its disk and one QEMU on the host
    vm = vm_reservation(Limits(pids=None, memory_bytes=None))
    assert vm.disk_bytes == 10 * GiB and 0 < vm.files <= 1024
    assert reservation(Limits(disk_bytes=None)).disk_bytes == 0  # documented: uncapped dirs


def test_settings_from_env():
    s = BudgetSettings.from_env({"ENVBUILD_HOST_RESERVE": "50%", "ENVBUILD_DISK_RESERVE": "0%",
                                 "ENVBUILD_NODE_BUDGET": "files=10,disk=1G, tasks=3"})
    assert (s.host_reserve, s.disk_reserve) == (0.5, 0.0)
    assert s.caps == {"files": 10, "disk_bytes": GiB, "tasks": 3}
    assert BudgetSettings.from_env({}) == BudgetSettings()
    for bad in ({"ENVBUILD_HOST_RESERVE": "100%"}, {"ENVBUILD_HOST_RESERVE": "0.3"},
                {"ENVBUILD_NODE_BUDGET": "fils=3"}, {"ENVBUILD_NODE_BUDGET": "files=-1"},
                {"ENVBUILD_NODE_BUDGET": "disk=lots"}):
        with pytest.raises(SettingsError):
            BudgetSettings.from_env(bad)
    assert parse_caps("") == {}


def test_default_cpus_is_a_share_of_the_host():
    """Issue 34, item 8: the default was 2.0 cores, the whole of a 2-core host."""
    assert default_cpus(2) == 1.0
    assert default_cpus(1) == 0.5
    assert default_cpus(64) == 2.0
    cpus = Limits().cpus
    assert cpus is not None and cpus == default_cpus() and cpus <= 2.0


def test_inotify_is_off_in_the_default_profile_unless_asked():
    """Issue 34, item 3: inotify instances are a per-uid table the host's root shares."""
    from runtime_shim.isolation.seccomp import default_profile
    from runtime_shim.isolation.spec import RuntimeSpecRequest, runtime_spec

    def rules(profile):
        return {n: (r["action"], r.get("errnoRet")) for r in profile["syscalls"]
                for n in r["names"] if n.startswith("inotify_init")}

    assert rules(default_profile()) == {"inotify_init": ("SCMP_ACT_ERRNO", 38),
                                        "inotify_init1": ("SCMP_ACT_ERRNO", 38)}
    assert rules(default_profile(inotify=True)) == {"inotify_init": ("SCMP_ACT_ALLOW", None),
                                                    "inotify_init1": ("SCMP_ACT_ALLOW", None)}
    spec = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("sh",), inotify=True))
    assert rules(spec["linux"]["seccomp"])["inotify_init1"][0] == "SCMP_ACT_ALLOW"
    assert Limits().inotify is False
