"""Issue 34 item 6: ``network=True`` reaches the public internet, not a site's own networks.

The attack: a networked sandbox opened services of other network namespaces of the host and of
other hosts on private addresses (the fleet's Ray cluster, which has no authentication). Here the
"other hosts" are one network namespace the test makes, behind a veth pair, holding an address
in each private range (RFC 1918, CGNAT, link-local) and one in the benchmarking range
198.18.0.0/15, the stand-in for the public internet (as in ``test_network.py``). Nothing
outside this machine is ever a target: every address below lives in the test's namespace.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import netns
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.security.netsite import http_servers, veth_namespace
from tests.security.test_network import _create, _free_port, _wget

#: (range, the test host's address in it); the host side of each /30 is the address minus 1.
PRIVATE = {"rfc1918-10": "10.213.{t}.2", "rfc1918-172": "172.29.{t}.2",
           "rfc1918-192": "192.168.{t}.2", "cgnat": "100.79.{t}.2",
           "link-local": "169.254.{t}.2"}
PUBLIC = "198.19.{t}.2"


@pytest.fixture(autouse=True)
def _tools():
    require_root()
    for tool in ("runc", "slirp4netns", "iptables-restore", "ip6tables-restore", "nsenter",
                 "unshare", "ip"):
        require_tool(tool)


class _Site:
    """The test's other host: its addresses by name and two ports its HTTP server answers."""

    def __init__(self, addrs: dict[str, str], ports: tuple[int, int]) -> None:
        self.addrs = addrs
        self.ports = ports

    @property
    def public(self) -> str:
        return self.addrs["public"]

    @property
    def private(self) -> dict[str, str]:
        return {k: v for k, v in self.addrs.items() if k != "public"}


@pytest.fixture
def site():
    """A network namespace with an address in every private range and one "public" one, each
    on its own /30 of one veth pair, an HTTP server on two ports of all of them; removed
    afterwards and checked to be gone."""
    t = random.randrange(256)  # a third octet per run: concurrent runs do not share subnets
    addrs = {k: v.format(t=t) for k, v in {**PRIVATE, "public": PUBLIC}.items()}
    links = [(addr.rsplit(".", 1)[0] + ".1/30", f"{addr}/30") for addr in addrs.values()]
    ports = (_free_port(), _free_port())
    with veth_namespace("site", links) as ns, \
            http_servers(ns, "0.0.0.0", ports, b"site-secret\n"):
        # The attack's precondition: every address answers from the host's namespace.
        for addr in addrs.values():
            with urllib.request.urlopen(f"http://{addr}:{ports[0]}/", timeout=5) as got:
                assert got.read() == b"site-secret\n", addr
        yield _Site(addrs, ports)


def _reaches(sb: Sandbox, addr: str, port: int) -> bool:
    code, out = _wget(sb, addr, port)
    assert (code == 0) == ("site-secret" in out), out  # refused means no byte of the answer
    return code == 0


def _reachable(sb: Sandbox, site: _Site, port: int | None = None) -> dict[str, bool]:
    return {name: _reaches(sb, addr, port or site.ports[0]) for name, addr in site.addrs.items()}


def _only(site: _Site, *names: str) -> dict[str, bool]:
    return {name: name in names for name in site.addrs}


def test_default_network_reaches_the_public_internet_only(busybox_store, site):
    with _create(busybox_store, network=True) as sb:
        assert _reachable(sb, site) == _only(site, "public")


def test_an_allow_list_entry_opens_a_private_destination(busybox_store, site):
    ten = site.addrs["rfc1918-10"]
    with _create(busybox_store, network=["public", f"{ten}/32:{site.ports[0]}"]) as sb:
        assert _reachable(sb, site) == _only(site, "public", "rfc1918-10")
        assert not _reaches(sb, ten, site.ports[1])  # that port only
    # Without "public": the entries and nothing else.
    cgnat = site.addrs["cgnat"]
    with _create(busybox_store, network=[f"{cgnat}/32"]) as sb:
        assert _reachable(sb, site) == _only(site, "cgnat")
        assert _reaches(sb, cgnat, site.ports[1])


def test_configured_cluster_addresses_are_refused(busybox_store, site, monkeypatch):
    """``$ENVBUILD_NETWORK_REFUSE`` (the cluster's addresses, public ones too) is refused to
    public egress, kept across ``set_network`` from another process, and opened only by an
    entry naming it."""
    store, node = busybox_store
    monkeypatch.setenv(netns.REFUSE_ENV, f"{site.public}/32")
    with _create(busybox_store, network=True) as sb:
        assert _reachable(sb, site) == _only(site)
        monkeypatch.delenv(netns.REFUSE_ENV)
        _cli_set_network(node, sb.id, "public")  # a process without the setting
        assert _reachable(sb, site) == _only(site)
        sb.set_network(["public", f"{site.public}/32"])
        assert _reachable(sb, site) == _only(site, "public")


def test_configured_mirrors_are_part_of_public(busybox_store, site, monkeypatch):
    """``$ENVBUILD_NETWORK_MIRRORS`` (a package mirror on a private address) is reached by
    public egress, on its port only, and by nothing else; recorded like the refused ones."""
    store, node = busybox_store
    ten = site.addrs["rfc1918-10"]
    monkeypatch.setenv(netns.MIRRORS_ENV, f"{ten}/32:{site.ports[0]}")
    with _create(busybox_store, network=True) as sb:
        assert _reachable(sb, site) == _only(site, "public", "rfc1918-10")
        assert not _reaches(sb, ten, site.ports[1])
        monkeypatch.delenv(netns.MIRRORS_ENV)
        _cli_set_network(node, sb.id)  # DNS only: the setup phase is over
        assert _reachable(sb, site) == _only(site)
        _cli_set_network(node, sb.id, "public")  # a process without the setting
        assert _reachable(sb, site) == _only(site, "public", "rfc1918-10")


def test_bad_refuse_setting_is_one_line(busybox_store, monkeypatch):
    store, node = busybox_store
    before = set(os.listdir(node / "sandboxes")) if (node / "sandboxes").exists() else set()
    monkeypatch.setenv(netns.REFUSE_ENV, "ray-head.internal")
    with pytest.raises(RuntimeShimError) as e:
        _create(busybox_store, network=True)
    assert netns.REFUSE_ENV in e.value.message and "\n" not in e.value.message and e.value.hint
    assert set(os.listdir(node / "sandboxes")) == before


def test_set_network_applies_to_new_connections_of_a_running_sandbox(busybox_store, site):
    """The task phases of an RL harness: the package index open during setup, closed while the
    agent works; a private mirror opened by name."""
    ten = site.addrs["rfc1918-10"]
    with _create(busybox_store, network=[]) as sb:
        assert _reachable(sb, site) == _only(site)
        sb.set_network(True)
        assert _reachable(sb, site) == _only(site, "public")
        sb.set_network(["public", f"{ten}/32"])
        assert _reachable(sb, site) == _only(site, "public", "rfc1918-10")
        sb.set_network([f"{ten}/32:{site.ports[1]}"])
        assert _reachable(sb, site) == _only(site)
        assert _reachable(sb, site, site.ports[1]) == _only(site, "rfc1918-10")
        sb.set_network([])
        assert _reachable(sb, site) == _only(site)
        assert _dns_accepts(sb) == 2  # [] keeps DNS (to slirp's forwarder)
        sb.set_network(False)
        assert _dns_accepts(sb) == 0 and _reachable(sb, site) == _only(site)


def test_set_network_cuts_a_connection_to_a_destination_now_refused(busybox_store, site):
    """The firewall keeps no connection state: a connection opened while a destination was
    allowed fails once it is not (nothing sent after the change gets out)."""
    with _create(busybox_store, network=True) as sb:
        sb.exec("(while true; do printf 'GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'; sleep 0.2; "
                f"done | nc {site.public} {site.ports[0]} > /tmp/got 2>&1 ; echo done "
                ">/tmp/nc-exit) >/dev/null 2>&1 &", timeout=10)
        assert _wait_for(sb, "grep -c site-secret /tmp/got", lambda n: int(n or 0) >= 2)
        sb.set_network([])
        assert _wait_for(sb, "cat /tmp/nc-exit", lambda s: s == "done")  # nc saw the reset
        answers = sb.exec("grep -c site-secret /tmp/got").stdout.decode().strip()
        assert sb.exec("sleep 1; grep -c site-secret /tmp/got").stdout.decode().strip() == \
            answers


def _wait_for(sb: Sandbox, cmd: str, ok, tries: int = 40) -> bool:
    for _ in range(tries):
        if ok(sb.exec(f"{cmd} 2>/dev/null; sleep 0.25").stdout.decode().strip()):
            return True
    return False


def test_set_network_refuses_bad_entries_and_sandboxes_without_network(busybox_store, site):
    with _create(busybox_store, network=True) as sb:
        with pytest.raises(RuntimeShimError) as e:
            sb.set_network(["public", "ray-head:10001"])
        assert "host names are not allowed" in e.value.message
        assert _reachable(sb, site) == _only(site, "public")  # unchanged
    with _create(busybox_store) as sb:
        with pytest.raises(RuntimeShimError) as e:
            sb.set_network(True)
        assert "no network namespace" in e.value.message and "network=[]" in e.value.hint
        links = sb.exec("ip -o link").stdout.decode().splitlines()
        assert [line.split(":")[1].strip() for line in links] == ["lo"]  # nothing was added


def test_cli_sandbox_network(busybox_store, site):
    store, node = busybox_store
    ten = site.addrs["rfc1918-10"]
    with _create(busybox_store, network=[]) as sb:
        out = _cli_set_network(node, sb.id, "public", f"{ten}/32")
        assert out == f"sandbox {sb.id} network: public {ten}/32 + DNS"
        assert _reachable(sb, site) == _only(site, "public", "rfc1918-10")
        assert _cli_set_network(node, sb.id, "--off") == f"sandbox {sb.id} network: off"
        assert _reachable(sb, site) == _only(site) and _dns_accepts(sb) == 0
    r = _cli(node, "sandbox", "network", "eb-000000000000", "public")
    assert r.returncode == 1 and r.stderr.startswith("error: no sandbox eb-000000000000")
    assert "Traceback" not in r.stderr


def test_fleet_daemon_set_network(busybox_store, site, tmp_path):
    """The fleet's node daemon (the real class; Ray only carries calls) changes a sandbox's
    egress by fleet id, and refuses ids that are not its live sandboxes."""
    from envbuild.errors import SandboxNotFound
    from runtime_shim.fleet.daemon import CreateSpec, DaemonConfig, NodeDaemon
    from runtime_shim.node.locks import resolve

    store, _ = busybox_store
    d = NodeDaemon(DaemonConfig(store=str(store.root), node_dir=str(tmp_path / "n-{node_id}"),
                                slots=2), node_id="cd" * 28)
    try:
        spec = CreateSpec(lock=resolve(store, "env/busybox-shell").digest, network=True)
        (rec,) = d.create_batch(spec, 1)
        sid = rec.id.split("@")[0]
        sb = d._entry(sid).sandbox
        assert _reachable(sb, site) == _only(site, "public")
        d.set_network(sid, ("public", f"{site.addrs['rfc1918-172']}/32"))
        assert _reachable(sb, site) == _only(site, "public", "rfc1918-172")
        for bad in ("../../x", "eb-0123456789ab"):
            with pytest.raises(SandboxNotFound):
                d.set_network(bad, True)
    finally:
        d.shutdown()


def test_microvm_default_network_and_set_network(busybox_store, site):
    """QEMU runs in the sandbox's namespace: the same firewall holds for the guest."""
    for tool in ("qemu-system-x86_64", "mkfs.erofs", "mkfs.ext4"):
        require_tool(tool)
    from runtime_shim.sdk.sandbox import Limits

    with _create(busybox_store, backend="microvm", network=True,
                 limits=Limits(memory_bytes=384 << 20)) as sb:
        assert _reachable(sb, site) == _only(site, "public")
        sb.set_network([f"{site.addrs['rfc1918-192']}/32"])
        assert _reachable(sb, site) == _only(site, "rfc1918-192")


def test_build_step_network_does_not_reach_private_hosts(envbuild_cli, site):
    """A hostile definition's run step with network on (the Ray cluster's reach): public
    egress only."""
    out = "/opt/toolkits/shtest/reach"
    fetch = " ; ".join(
        f"wget -q -O {out}/{name} http://{addr}:{site.ports[0]}/ 2>/dev/null || "
        f"echo refused >{out}/{name}" for name, addr in site.addrs.items())
    kit = envbuild_cli.defs / "toolkits" / "shtest.yaml"
    kit.write_text(kit.read_text().replace(
        "steps:\n", f"steps:\n  - run: 'mkdir -p {out} ; {fetch}'\n", 1))
    r = envbuild_cli("build")
    assert r.code == 0, r.err
    r = envbuild_cli("run", "busybox-shell", "sh", "-c",
                     f"cd {out} && for f in *; do echo $f=$(cat $f); done")
    assert r.code == 0, r.err
    got = dict(line.split("=", 1) for line in r.out.split())
    assert got == {name: "site-secret" if name == "public" else "refused"
                   for name in site.addrs}, got


def test_dockerfile_network_host_does_not_reach_private_hosts(envbuild_cli, site,
                                                              monkeypatch):
    """``network: host`` in a Dockerfile base: its RUN steps run in the private dockerd's
    namespace behind slirp4netns, with the same public-only egress."""
    from tests.integration.test_dockerfile_base import _require_docker
    from tests.security.test_dockerfile_inputs import network_host_probes

    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    got = network_host_probes(envbuild_cli, {name: (addr, site.ports[0])
                                             for name, addr in site.addrs.items()}, "site-secret")
    assert got == {name: "open" if name == "public" else "refused" for name in site.addrs}


def _dns_accepts(sb: Sandbox) -> int:
    """ACCEPT rules for DNS in the sandbox's firewall (read from the host, nothing sent)."""
    rules = subprocess.run(["nsenter", f"--net={sb.paths.root / 'netns'}", "iptables", "-S",
                            "OUTPUT"], capture_output=True, text=True, check=True).stdout
    return sum(f"-d {netns.SLIRP_DNS}/32" in line and "ACCEPT" in line
               for line in rules.splitlines())


def _cli(node: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([sys.executable, "-m", "envbuild.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def _cli_set_network(node: Path, sandbox_id: str, *args: str) -> str:
    r = _cli(node, "sandbox", "network", sandbox_id, *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()
