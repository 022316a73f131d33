import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.spec import (BindMount, Rlimit, RuntimeSpecRequest, parse_user,
                               runtime_spec)
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
