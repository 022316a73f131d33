"""E2B's network rules through ``envbuild serve`` with the real ``e2b`` SDK (issue 37): a
create's ``network``/``allow_internet_access`` and live ``update_network`` change what a real
runc sandbox reaches; what envbuild's firewall cannot express is refused in one line and
changes nothing; one sandbox's rules never change another's.

The destinations are a network namespace the test makes (``tests.security.netsite``), with a
private address (10.x) and a stand-in for the public internet (198.19.x, the benchmarking
range): nothing outside this machine is ever a target."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.conftest import require_root, require_tool
from tests.e2b_server import API_KEY, e2b_env, running_server
from tests.integration.conftest import build_busybox_env
from tests.security.netsite import http_servers, veth_namespace
from tests.security.test_network import _free_port

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"
ALL = "0.0.0.0/0"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_root()
    for tool in ("runc", "slirp4netns", "iptables-restore", "nsenter", "ip"):
        require_tool(tool)
    root = tmp_path_factory.mktemp("e2bnet")
    store, node = build_busybox_env(root)
    with running_server(root, store.root, node) as srv, e2b_env(srv):
        yield srv


@pytest.fixture(scope="module")
def site():
    """{"ten": private address, "public": the internet's stand-in} and the port answering."""
    t = random.randrange(256)
    addrs = {"ten": f"10.214.{t}.2", "public": f"198.19.{t}.6"}
    links = [(a.rsplit(".", 1)[0] + f".{int(a.rsplit('.', 1)[1]) - 1}/30", f"{a}/30")
             for a in addrs.values()]
    port = _free_port()
    with veth_namespace("e2bnet", links) as ns, http_servers(ns, "0.0.0.0", (port,),
                                                             b"site-secret\n"):
        yield addrs, port


def _reachable(sb, site) -> set[str]:
    """The site's names ``sb`` reaches now (a command in the sandbox, through the SDK)."""
    addrs, port = site
    found = set()
    for name, addr in addrs.items():
        r = sb.commands.run(f"wget -q -O - http://{addr}:{port}/ 2>&1 || true", timeout=30)
        if "site-secret" in r.stdout:
            found.add(name)
    return found


def test_create_and_live_rules_change_what_the_sandbox_reaches(server, site):
    from e2b import Sandbox

    ten = site[0]["ten"]
    sb = Sandbox.create(TEMPLATE, timeout=300, network={"deny_out": [ALL]})
    try:
        assert _reachable(sb, site) == set()
        sb.update_network({"allow_out": [ten], "deny_out": [ALL]})
        assert _reachable(sb, site) == {"ten"}
        info = sb.get_info()
        assert info.allow_internet_access is False and info.network["allow_out"] == [f"{ten}/32"]
        sb.update_network({})  # E2B: every rule cleared, all traffic allowed
        assert _reachable(sb, site) == {"public"}  # never a private range without allow_out
        assert sb.get_info().allow_internet_access is True
        sb.update_network({"allow_internet_access": False})
        assert _reachable(sb, site) == set()
        r = sb.commands.run("nslookup localhost 2>&1; true", timeout=30)  # not even DNS
        assert "10.0.2.3" in r.stdout and "Address" not in r.stdout.split("10.0.2.3", 1)[1]
    finally:
        sb.kill()
    sb = Sandbox.create(TEMPLATE, timeout=300, allow_internet_access=True)
    try:
        assert _reachable(sb, site) == {"public"}
        public = site[0]["public"]
        sb.update_network({"deny_out": [public]})  # a part of the internet taken out
        assert _reachable(sb, site) == set()
        assert sb.get_info().network["deny_out"] == [f"{public}/32"]
        sb.update_network({"deny_out": [public], "allow_out": [public]})  # allow wins
        assert _reachable(sb, site) == {"public"}
    finally:
        sb.kill()


def test_rules_envbuild_cannot_express_are_refused_in_one_line(server, site):
    from e2b import Sandbox, SandboxException

    with pytest.raises(SandboxException) as e:
        Sandbox.create(TEMPLATE, network={"allow_out": ["example.com"], "deny_out": [ALL]})
    assert "400" in str(e.value) and "host names" in str(e.value)
    ten = site[0]["ten"]
    sb = Sandbox.create(TEMPLATE, timeout=300, network={"allow_out": [ten], "deny_out": [ALL]})
    try:
        for bad, words in (({"allow_out": ["example.com"]}, "host names"),
                           ({"allow_out": ["::1"]}, "IPv6"),
                           ({"egress_proxy": {"address": "127.0.0.1:1080"}}, "egressProxy")):
            with pytest.raises(SandboxException) as e:
                sb.update_network(bad)
            assert "400" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
        assert _reachable(sb, site) == {"ten"}  # nothing changed
    finally:
        sb.kill()
    plain = Sandbox.create(TEMPLATE, timeout=300)  # no network option: no network at all
    try:
        with pytest.raises(SandboxException) as e:
            plain.update_network({"allow_out": [ten], "deny_out": [ALL]})
        assert "has no network to change" in str(e.value)
    finally:
        plain.kill()


def test_one_sandboxs_rules_never_change_anothers(server, site):
    from e2b import Sandbox

    ten = site[0]["ten"]
    a = Sandbox.create(TEMPLATE, timeout=300, network={"deny_out": [ALL]})
    b = Sandbox.create(TEMPLATE, timeout=300, network={"deny_out": [ALL]})
    try:
        a.update_network({"allow_out": [ten], "deny_out": [ALL]})
        assert _reachable(a, site) == {"ten"}
        assert _reachable(b, site) == set()
        # the control plane needs the API key; a sandbox's own tokens do not open it
        for headers in ({}, {"X-API-KEY": b._envd_access_token or "x"},
                        {"X-Access-Token": b._envd_access_token or "x"}):
            r = httpx.put(f"{server.url}/sandboxes/{b.sandbox_id}/network", headers=headers,
                          json={"allowOut": [ten]})
            assert r.status_code == 401, r.text
        assert httpx.put(f"{server.url}/sandboxes/nope/network", headers={"X-API-KEY": API_KEY},
                         json={}).status_code == 404
        assert _reachable(b, site) == set()
        b.update_network({})
        assert _reachable(b, site) == {"public"} and _reachable(a, site) == {"ten"}
    finally:
        a.kill()
        b.kill()


def test_rules_survive_pause_and_resume(server, site):
    from e2b import Sandbox

    ten = site[0]["ten"]
    sb = Sandbox.create(TEMPLATE, timeout=300, network={"deny_out": [ALL]})
    try:
        sb.update_network({"allow_out": [ten], "deny_out": [ALL]})
        assert sb.pause()
        sb = Sandbox.connect(sb.sandbox_id)
        assert _reachable(sb, site) == {"ten"}
        sb.update_network({})  # the resumed sandbox's rules still change live
        assert _reachable(sb, site) == {"public"}
    finally:
        sb.kill()
