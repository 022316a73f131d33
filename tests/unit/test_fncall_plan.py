"""FnCall's pure parts: the seccomp profile and the slot plan (no subprocess)."""

from __future__ import annotations

import os

from runtime_shim.backends.fncall import FNCALL_DENIED_SYSCALLS, fncall_profile, plan_slots
from runtime_shim.isolation.seccomp import default_profile
from runtime_shim.isolation.spec import DEFAULT_CAPABILITIES


def _names(profile):
    return {n for rule in profile["syscalls"] for n in rule["names"]}


def test_profile_is_the_default_minus_ipc_namespace_objects():
    base, fn = default_profile(DEFAULT_CAPABILITIES), fncall_profile(DEFAULT_CAPABILITIES)
    assert FNCALL_DENIED_SYSCALLS & _names(base)  # the default does allow some of them
    assert not FNCALL_DENIED_SYSCALLS & _names(fn)
    assert _names(base) - _names(fn) == FNCALL_DENIED_SYSCALLS & _names(base)
    assert fn["defaultAction"] == base["defaultAction"]


def test_slots_are_top_level_dirs_but_runc_mounts_and_symlinks_then_dev_shm(tmp_path):
    base = tmp_path / "base"
    for d in ("usr", "tmp", "etc", "proc", "sys", "dev", ".envbuild", "root"):
        (base / d).mkdir(parents=True)
    os.symlink("usr/bin", base / "bin")
    (base / "file").write_text("x")
    slots = plan_slots(base, tmp_path / "empty")
    assert [s.dest for s in slots] == ["/etc", "/root", "/tmp", "/usr", "/dev/shm"]
    assert slots[-1].lower == tmp_path / "empty"
    assert slots[0].lower == base / "etc"
