"""``runtime_shim.sdk.ports``' refusals, before any connection: another backend than
containers, a sandbox whose init is gone, a namespace that is the host's own (its ports would
be the host's), a value that is not a TCP port."""

from __future__ import annotations

import dataclasses
import os

import pytest

from envbuild.errors import BackendUnavailable, RuntimeShimError, SandboxNotFound
from runtime_shim.sdk import ports


@dataclasses.dataclass
class Target:
    id: str = "sb1"
    backend: str = "container"
    host_pid: int | None = None


def test_only_container_sandboxes_have_reachable_ports():
    with pytest.raises(BackendUnavailable, match="ports of a vm sandbox") as e:
        ports.netns_path(Target(backend="vm", host_pid=os.getpid()))
    assert e.value.hint


def test_a_gone_sandbox_is_not_found():
    with pytest.raises(SandboxNotFound, match="sb1 is not running"):
        ports.netns_path(Target(host_pid=None))


def test_the_hosts_own_namespace_is_refused():
    """A process of this host's namespace (this test): connecting there would reach the
    host's loopback services."""
    with pytest.raises(RuntimeShimError, match="shares the host's network namespace"):
        ports.netns_path(Target(host_pid=os.getpid()))
    with pytest.raises(RuntimeShimError, match="shares the host's network namespace"):
        ports.connect(Target(host_pid=os.getpid()), 80)


@pytest.mark.parametrize("port", [0, -1, 65536, True, "80", 80.0, None])
def test_a_port_must_be_a_tcp_port(port):
    with pytest.raises(RuntimeShimError, match="is not a TCP port"):
        ports.check_port(port)
