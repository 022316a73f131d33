"""``envbuild.serve.egress``: E2B's egress rules → ``Sandbox.set_network``'s argument; what
envbuild's firewall cannot express is refused with one line, never dropped silently."""

from __future__ import annotations

import pytest

from envbuild.serve.egress import NetworkRefused, create_network, described, e2b_network


@pytest.mark.parametrize(("config", "access", "expected"), [
    ({}, None, ["public"]),                                   # E2B: everything allowed
    ({}, True, ["public"]),
    ({}, False, False),                                       # deny all, allow nothing
    ({"denyOut": ["0.0.0.0/0"]}, None, False),
    ({"denyOut": ["0.0.0.0/0"], "allowOut": ["198.18.0.7", "10.1.0.0/16"]}, None,
     ["198.18.0.7/32", "10.1.0.0/16"]),
    ({"allowOut": ["198.18.0.7"]}, False, ["198.18.0.7/32"]),
    ({"allowOut": ["10.0.0.0/8"]}, None, ["public", "10.0.0.0/8"]),  # a private one opened
    ({"denyOut": ["10.0.0.0/8", "169.254.169.254"]}, None,
     ["public", "!10.0.0.0/8", "!169.254.169.254/32"]),
    ({"denyOut": ["8.8.8.8"], "allowOut": ["8.8.8.8"]}, None, ["public", "8.8.8.8/32", "!8.8.8.8/32"]),
    ({"denyOut": ["198.51.100.9/24"]}, None, ["public", "!198.51.100.0/24"]),
    ({"denyOut": ["0.0.0.0/0"], "dnsServers": ["1.1.1.1"]}, None, False),
    ({"allowOut": ["198.18.0.7:8080"], "denyOut": ["0.0.0.0/0"]}, None, ["198.18.0.7/32:8080"]),
    ({"allowPublicTraffic": False, "rules": {}, "httpsPorts": []}, None, ["public"]),
])
def test_mapped(config, access, expected):
    assert e2b_network(config, access) == expected


@pytest.mark.parametrize(("config", "access", "words"), [
    ({"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"]}, None, "host names"),
    ({"denyOut": ["example.com"]}, None, "not an IPv4 address"),
    ({"allowOut": ["::1"]}, None, "IPv6"),
    ({"allowOut": ["127.0.0.1"]}, None, "never reachable"),
    ({"allowOut": "1.2.3.4"}, None, "list of strings"),
    ({"egressProxy": {"address": "p:1080"}}, None, "egressProxy"),
    ({"rules": {"a.com": [{}]}}, None, "rules"),
    ({"allowPublicTraffic": True}, None, "traffic access token"),
    ({"maskRequestHost": "${PORT}-x.example.com"}, None, "maskRequestHost"),
    ({"httpsPorts": [3000]}, None, "httpsPorts"),
    ({}, "no", "allow_internet_access"),
])
def test_refused_in_one_line(config, access, words):
    with pytest.raises(NetworkRefused) as e:
        e2b_network(config, access)
    assert words in e.value.line() and "\n" not in e.value.line()


def test_create_has_a_network_only_when_asked():
    assert create_network({}) is None
    assert create_network({"network": {"allowPublicTraffic": False}}) is None
    assert create_network({"allow_internet_access": True}) == ["public"]
    assert create_network({"network": {"denyOut": ["0.0.0.0/0"]}}) is False
    with pytest.raises(NetworkRefused):  # refused even where no network would be made
        create_network({"network": {"egressProxy": {"address": "p:1"}}})


def test_described_as_e2b_reports_it():
    assert described(None) == {}
    assert described(False) == {"allowInternetAccess": False,
                                "network": {"allowOut": [], "denyOut": ["0.0.0.0/0"]}}
    assert described(["198.18.0.7/32"])["network"]["allowOut"] == ["198.18.0.7/32"]
    assert described(["public", "10.0.0.0/8"]) == {"allowInternetAccess": True,
                                                   "network": {"allowOut": ["10.0.0.0/8"]}}
    assert described(["public", "!8.8.8.8/32"])["network"] == {"allowOut": [],
                                                               "denyOut": ["8.8.8.8/32"]}
