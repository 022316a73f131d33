import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.spec import BindMount, Rlimit, RuntimeSpecRequest, parse_user, runtime_spec
from tests.oci_schemas import RUNTIME_SPEC, assert_valid


def _ns(config):
    return {n["type"] for n in config["linux"]["namespaces"]}


def test_default_spec_is_isolated_and_valid():
    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",)))
    assert_valid(RUNTIME_SPEC, "config-schema.json", config)
    assert _ns(config) == {"pid", "ipc", "uts", "mount", "network"}
    assert config["process"]["noNewPrivileges"] is True
    caps = set(config["process"]["capabilities"]["bounding"])
    assert "CAP_SYS_ADMIN" not in caps and "CAP_NET_RAW" not in caps and "CAP_MKNOD" not in caps
    assert "/proc/kcore" in config["linux"]["maskedPaths"]
    sys_mount = next(m for m in config["mounts"] if m["destination"] == "/sys")
    assert "ro" in sys_mount["options"]


def test_full_spec_with_limits_binds_and_network_is_valid():
    req = RuntimeSpecRequest(
        rootfs="/r", args=("sh", "-c", "x"), env=("A=1",), cwd="/w", uid=1000, gid=1000,
        additional_gids=(5,), hostname="h", network=True, readonly_rootfs=True,
        rlimits=(Rlimit("RLIMIT_NOFILE", 1024, 1024),), pids_limit=64,
        memory_limit=256 << 20, cgroups_path="/envbuild/eb-1",
        binds=(BindMount("/etc/resolv.conf", "/etc/resolv.conf"),))
    config = runtime_spec(req)
    assert_valid(RUNTIME_SPEC, "config-schema.json", config)
    assert "network" not in _ns(config)
    assert config["linux"]["resources"]["pids"] == {"limit": 64}
    assert config["root"] == {"path": "/r", "readonly": True}


@pytest.mark.parametrize("text,expected", [("0:0", (0, 0)), ("1000", (1000, 1000)),
                                           ("5:6", (5, 6)), (None, (0, 0))])
def test_parse_user(text, expected):
    assert parse_user(text) == expected


def test_parse_user_rejects_names():
    with pytest.raises(RuntimeShimError, match="not numeric"):
        parse_user("nobody")


# --- seccomp and CPU ----------------------------------------------------------------------

import copy  # noqa: E402
import errno  # noqa: E402

from runtime_shim.isolation import seccomp  # noqa: E402


def _rules(profile, name):
    return [r for r in profile["syscalls"] if name in r["names"]]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "riscv64"])
def test_default_spec_has_the_default_seccomp_profile(machine):
    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), machine=machine))
    assert_valid(RUNTIME_SPEC, "config-schema.json", config)
    profile = config["linux"]["seccomp"]
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["defaultErrnoRet"] == errno.EPERM
    if machine == "x86_64":
        assert profile["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"]
    elif machine == "riscv64":
        assert "architectures" not in profile  # native only
    allowed = {n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not
               r.get("args") for n in r["names"]}
    for refused in ("keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
                    "io_uring_setup", "io_uring_enter", "io_uring_register", "setns", "mount",
                    "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
                    "fsmount", "fspick", "mount_setattr", "kexec_load", "kexec_file_load",
                    "init_module", "finit_module", "delete_module", "unshare", "clone",
                    "clone3", "ioctl", "socket", "personality", "open_by_handle_at"):
        assert refused not in allowed, refused
    assert {"read", "execve", "fork", "chroot", "ptrace"} <= allowed  # chroot: CAP_SYS_CHROOT
    assert _rules(profile, "clone3") == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO",
                                          "errnoRet": errno.ENOSYS}]
    (unshare,) = _rules(profile, "unshare")
    assert unshare["args"] == [{"index": 0, "value": seccomp.UNSHARE_NAMESPACES, "valueTwo": 0,
                                "op": "SCMP_CMP_MASKED_EQ"}]
    assert seccomp.CLONE_NEWUSER & seccomp.CLONE_NAMESPACES


def test_profile_follows_capabilities():
    without = seccomp.default_profile((), "x86_64")
    with_caps = seccomp.default_profile(("CAP_SYS_CHROOT", "CAP_SYS_ADMIN"), "x86_64")
    assert not _rules(without, "chroot") and _rules(with_caps, "chroot")
    # CAP_SYS_ADMIN never brings Docker's mount/namespace group
    assert not _rules(with_caps, "mount") and not _rules(with_caps, "setns")


def _ioctl_allowed(profile, cmd):
    return any(r["action"] == "SCMP_ACT_ALLOW" and all(
        a["op"] == "SCMP_CMP_MASKED_EQ" and cmd & a["value"] == a["valueTwo"] for a in r["args"])
        for r in _rules(profile, "ioctl"))


def test_ioctl_rules_allow_exactly_the_complement_of_the_deny_list():
    import random

    profile = seccomp.default_profile((), "x86_64")
    assert all(r["action"] == "SCMP_ACT_ALLOW" and len(r["args"]) == 1
               for r in _rules(profile, "ioctl"))
    swapext = (3 << 30) | (192 << 16) | (ord("X") << 8) | 109  # _IOWR('X', 109, 192 bytes)
    for denied in (swapext, swapext & ~(0x3FFF << 16), 0x5412, 0x541C, 0xC028660F,
                   0x6611, 0xFFFFFFFF00005412, 0xAB00005412):
        assert not _ioctl_allowed(profile, denied), hex(denied)
    for ok in (0x5401, 0x541B, 0x5413, 0x80086601, 0xFFFFFFFF80086601, 0x8914, 0x5410):
        assert _ioctl_allowed(profile, ok), hex(ok)
    rng = random.Random(11)
    for _ in range(20000):
        cmd = rng.getrandbits(64)
        denied = any(cmd & mask == value for _n, value, mask in seccomp.IOCTL_DENY)
        assert _ioctl_allowed(profile, cmd) != denied, hex(cmd)


def test_unconfined_and_custom_profiles():
    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), seccomp="unconfined"))
    assert_valid(RUNTIME_SPEC, "config-schema.json", config)
    assert "seccomp" not in config["linux"]
    custom = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
              "flags": ["SECCOMP_FILTER_FLAG_LOG"],
              "syscalls": [{"names": ["keyctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                            "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_GE"}]}]}
    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), seccomp=custom))
    assert_valid(RUNTIME_SPEC, "config-schema.json", config)
    assert config["linux"]["seccomp"] == custom
    assert config["linux"]["seccomp"] is not custom  # a copy: later changes do not leak in


BAD_PROFILES = [
    {},
    {"defaultAction": "ALLOW"},
    {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": -1},
    {"defaultAction": "SCMP_ACT_ERRNO", "architectures": ["SCMP_ARCH_Z80"]},
    {"defaultAction": "SCMP_ACT_ERRNO", "flags": "SECCOMP_FILTER_FLAG_LOG"},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": [], "action": "SCMP_ACT_ALLOW"}]},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"]}]},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["read"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 1 << 64, "op": "SCMP_CMP_EQ"}]}]},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["read"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_MASKED"}]}]},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["read"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "op": "SCMP_CMP_EQ"}]}]},
]


@pytest.mark.parametrize("bad", BAD_PROFILES, ids=range(len(BAD_PROFILES)))
def test_bad_profiles_are_refused_like_the_schema_does(bad):
    from tests.oci_schemas import validator

    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), seccomp="unconfined"))
    config["linux"]["seccomp"] = copy.deepcopy(bad)
    assert list(validator(RUNTIME_SPEC, "config-schema.json").iter_errors(config)), \
        "the schema accepts it: the case proves nothing"
    with pytest.raises(RuntimeShimError, match="seccomp profile"):
        runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), seccomp=bad))


def test_unknown_seccomp_setting_and_typo_key_are_refused():
    with pytest.raises(RuntimeShimError, match="unknown seccomp setting"):
        seccomp.check_setting("default")
    with pytest.raises(RuntimeShimError, match="unknown key 'defaultErrno'"):
        seccomp.check_setting({"defaultAction": "SCMP_ACT_ERRNO", "defaultErrno": 1})


@pytest.mark.parametrize("cpus,quota", [(2.0, 200_000), (0.5, 50_000), (0.001, 1000)])
def test_cpus_become_cfs_quota(cpus, quota):
    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), cpus=cpus))
    assert_valid(RUNTIME_SPEC, "config-schema.json", config)
    assert config["linux"]["resources"]["cpu"] == {"quota": quota, "period": 100_000}
    assert "cpu" not in runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("x",)))["linux"][
        "resources"]


@pytest.mark.parametrize("cpus", [0, -1.0, float("nan")])
def test_nonpositive_cpus_are_refused(cpus):
    with pytest.raises(RuntimeShimError, match="positive"):
        runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), cpus=cpus))
