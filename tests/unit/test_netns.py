"""The pure planning of ``runtime_shim.isolation.netns``: allow-list parsing and the firewall rules."""

from __future__ import annotations

import ipaddress

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import netns
from runtime_shim.isolation.spec import DEFAULT_CAPABILITIES, RuntimeSpecRequest, runtime_spec


def test_parse_network_shapes():
    assert netns.parse_network(False) is None
    assert netns.parse_network(None) is None
    assert netns.parse_network(True) == netns.NetworkPolicy(public=True, allow=())
    assert netns.parse_network(["public"]) == netns.parse_network(True)
    assert netns.parse_network([]) == netns.NetworkPolicy(public=False, allow=())
    policy = netns.parse_network(["10.0.0.0/8:443", "198.18.0.7"])
    assert policy.allow == (netns.Allow(ipaddress.IPv4Network("10.0.0.0/8"), 443),
                            netns.Allow(ipaddress.IPv4Network("198.18.0.7/32"), None))
    assert [str(a) for a in policy.allow] == ["10.0.0.0/8:443", "198.18.0.7/32"]
    assert not policy.public
    both = netns.parse_network(["10.1.2.3:3141", " public "])
    assert both.public and both.entries() == ["public", "10.1.2.3/32:3141"]
    assert netns.parse_network(both.entries()) == both


@pytest.mark.parametrize("bad, words", [
    ("", "empty"),
    ("10.0.0.0/8:", "port"),
    ("10.0.0.0/8:0", "port"),
    ("10.0.0.0/8:http", "port"),
    ("example.com", "host names are not allowed"),
    ("example.com:80", "host names are not allowed"),
    ("10.0.0.1/8", "host bits"),
    ("127.0.0.0/8", "never reachable"),
    ("10.0.2.3:53", "never reachable"),
    ("::1", "IPv6"),
    ("[fd00::1]:443", "IPv6"),
])
def test_bad_entries_are_one_line_errors(bad, words):
    with pytest.raises(RuntimeShimError) as e:
        netns.parse_network([bad])
    assert words in e.value.message and "\n" not in e.value.message and e.value.hint


@pytest.mark.parametrize("bad", ["10.0.0.0/8", 3, {"a": 1}])
def test_network_must_be_bool_or_list(bad):
    with pytest.raises(RuntimeShimError):
        netns.parse_network(bad)


#: What issue 34 item 6 names: RFC 1918, CGNAT, link-local, loopback.
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                  "169.254.0.0/16", "127.0.0.0/8")


NODE = netns.NodeNetwork.from_env({"ENVBUILD_NETWORK_REFUSE": "203.0.113.0/24,198.51.100.7",
                                   "ENVBUILD_NETWORK_MIRRORS": "10.9.0.5:3142"})


def _out(rules: str) -> list[str]:
    return [line for line in rules.splitlines() if line.startswith("-A OUTPUT")]


def test_rules_refuse_the_host_before_the_policy():
    rules = netns.firewall_rules(netns.NetworkPolicy(), ["192.0.2.2"], ["10.255.255.53"])
    assert ":OUTPUT DROP [0:0]" in rules and rules.rstrip().endswith("COMMIT")
    out = _out(rules)
    assert out[0] == "-A OUTPUT -o lo -j ACCEPT"
    accept_tap = out.index("-A OUTPUT -o tap0 -j ACCEPT")
    for refused in ("10.0.2.0/24", "192.0.2.2/32", *PRIVATE_RANGES):
        i = out.index(f"-A OUTPUT -d {refused} -p tcp -j REJECT --reject-with tcp-reset")
        assert i < accept_tap
    dns = out.index("-A OUTPUT -d 10.0.2.3/32 -p udp --dport 53 -j ACCEPT")
    assert dns < out.index("-A OUTPUT -d 10.0.2.0/24 -p tcp -j REJECT --reject-with tcp-reset")
    assert "-A OUTPUT -d 10.255.255.53/32 -p udp --dport 53 -j ACCEPT" in out
    assert out[-1] == "-A OUTPUT -j REJECT --reject-with icmp-port-unreachable"


def test_a_resolver_on_a_host_address_is_not_opened():
    out = _out(netns.firewall_rules(netns.NetworkPolicy(), ["192.0.2.2"], ["192.0.2.2"]))
    assert not [r for r in out if r.startswith("-A OUTPUT -d 192.0.2.2/32") and "ACCEPT" in r]


def test_allow_list_rules_only_name_the_entries():
    policy = netns.parse_network(["198.18.0.0/15:443", "203.0.113.9"])
    out = _out(netns.firewall_rules(policy, ["192.0.2.2"]))
    assert "-A OUTPUT -o tap0 -j ACCEPT" not in out
    assert "-A OUTPUT -o tap0 -d 198.18.0.0/15 -p tcp --dport 443 -j ACCEPT" in out
    assert "-A OUTPUT -o tap0 -d 198.18.0.0/15 -p udp --dport 443 -j ACCEPT" in out
    assert "-A OUTPUT -o tap0 -d 203.0.113.9/32 -j ACCEPT" in out
    assert out.index("-A OUTPUT -d 192.0.2.2/32 -p tcp -j REJECT --reject-with tcp-reset") < \
        out.index("-A OUTPUT -o tap0 -d 203.0.113.9/32 -j ACCEPT")


def test_allow_entries_open_private_ranges_but_never_the_host():
    policy = netns.parse_network(["public", "10.1.2.0/24:8080", "192.0.2.0/24"])
    out = _out(netns.firewall_rules(policy, ["192.0.2.2"], node=NODE))
    host = out.index("-A OUTPUT -d 192.0.2.2/32 -p tcp -j REJECT --reject-with tcp-reset")
    entry = out.index("-A OUTPUT -o tap0 -d 10.1.2.0/24 -p tcp --dport 8080 -j ACCEPT")
    cluster = out.index("-A OUTPUT -d 203.0.113.0/24 -p tcp -j REJECT --reject-with tcp-reset")
    mirror = out.index("-A OUTPUT -o tap0 -d 10.9.0.5/32 -p tcp --dport 3142 -j ACCEPT")
    private = out.index("-A OUTPUT -d 10.0.0.0/8 -p tcp -j REJECT --reject-with tcp-reset")
    assert host < entry < cluster < mirror < private < out.index("-A OUTPUT -o tap0 -j ACCEPT")


def test_without_public_nothing_else_is_accepted():
    for policy in (netns.parse_network([]), netns.CLOSED):
        out = _out(netns.firewall_rules(policy, ["192.0.2.2"], ["10.255.255.53"], NODE))
        assert [r for r in out if r.endswith("ACCEPT") and "--dport 53" not in r] == \
            ["-A OUTPUT -o lo -j ACCEPT"]
        assert bool([r for r in out if "--dport 53" in r]) == policy.dns


def test_ipv6_rules_allow_only_loopback():
    out = _out(netns.firewall6_rules())
    assert out[0] == "-A OUTPUT -o lo -j ACCEPT"
    assert all("REJECT" in r for r in out[1:])
    assert ":OUTPUT DROP [0:0]" in netns.firewall6_rules()


@pytest.mark.parametrize("var, text, words", [
    ("ENVBUILD_NETWORK_REFUSE", "10.0.0.1/8", "host bits"),
    ("ENVBUILD_NETWORK_REFUSE", "ray-head", "ray-head"),
    ("ENVBUILD_NETWORK_REFUSE", "fd00::/8", "fd00::/8"),
    ("ENVBUILD_NETWORK_MIRRORS", "mirror.internal:3142", "host names are not allowed"),
    ("ENVBUILD_NETWORK_MIRRORS", "127.0.0.1:3142", "never reachable"),
])
def test_bad_node_settings_are_one_line_errors(var, text, words):
    with pytest.raises(RuntimeShimError) as e:
        netns.NodeNetwork.from_env({var: f"203.0.113.0/24, {text}"})
    assert words in e.value.message and e.value.message.startswith(var)
    assert "\n" not in e.value.message and e.value.hint


def test_node_settings_parse_and_round_trip_through_the_record():
    assert netns.NodeNetwork.from_env({}) == netns.NodeNetwork()
    assert netns.NodeNetwork.from_env({"ENVBUILD_NETWORK_REFUSE": " , "}) == netns.NodeNetwork()
    assert NODE.refused == (ipaddress.IPv4Network("203.0.113.0/24"),
                            ipaddress.IPv4Network("198.51.100.7/32"))
    assert [str(a) for a in NODE.mirrors] == ["10.9.0.5/32:3142"]
    assert netns.NodeNetwork.from_record(NODE.to_record()) == NODE


def test_resolv_conf_points_at_slirp():
    assert netns.resolv_conf().splitlines()[0] == "nameserver 10.0.2.3"


def test_host_resolvers_skip_loopback(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.53\nnameserver 10.255.255.53\nnameserver fd00::1\n"
                    "search x\n")
    assert netns.host_resolvers(str(conf)) == ("10.255.255.53",)
    assert netns.host_resolvers(str(tmp_path / "missing")) == ()


def test_spec_joins_the_namespace_file_and_nobody_can_change_the_firewall():
    config = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), network=True,
                                             network_ns="/n/sandboxes/eb-1/netns"))
    nets = [n for n in config["linux"]["namespaces"] if n["type"] == "network"]
    assert nets == [{"type": "network", "path": "/n/sandboxes/eb-1/netns"}]
    assert "CAP_NET_ADMIN" not in DEFAULT_CAPABILITIES and "CAP_NET_RAW" not in DEFAULT_CAPABILITIES
    assert "CAP_SYS_ADMIN" not in DEFAULT_CAPABILITIES


def test_spec_with_a_namespace_file_is_valid():
    from tests.oci_schemas import RUNTIME_SPEC, assert_valid

    assert_valid(RUNTIME_SPEC, "config-schema.json",
                 runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), network=True,
                                                 network_ns="/n/sandboxes/eb-1/netns")))

