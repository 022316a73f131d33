"""``network=`` deny entries (``"!CIDR"``, runtime_shim.isolation.netns): parsed, round-tripped
through ``entries()``, refused before ``public`` accepts anything and after the allow-list
(an allowed entry wins, as E2B's allowOut over denyOut); bad ones refused in one line."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import netns


def _out(rules: str) -> list[str]:
    return [line for line in rules.splitlines() if line.startswith("-A OUTPUT")]


def test_deny_entries_are_refused_between_the_allow_list_and_public():
    policy = netns.parse_network(["public", "!198.51.100.0/24", "198.51.100.7", "!8.8.8.8"])
    assert [str(n) for n in policy.deny] == ["198.51.100.0/24", "8.8.8.8/32"]
    assert netns.parse_network(policy.entries()) == policy
    out = _out(netns.firewall_rules(policy, ["192.0.2.2"]))
    allowed = out.index("-A OUTPUT -o tap0 -d 198.51.100.7/32 -j ACCEPT")
    denied = out.index("-A OUTPUT -d 198.51.100.0/24 -p tcp -j REJECT --reject-with tcp-reset")
    assert allowed < denied < out.index("-A OUTPUT -o tap0 -j ACCEPT")
    assert "-A OUTPUT -d 8.8.8.8/32 -j REJECT --reject-with icmp-port-unreachable" in out


def test_without_public_a_deny_entry_changes_nothing():
    with_deny = netns.firewall_rules(netns.parse_network(["!8.8.8.8", "10.0.0.0/8"]), [])
    assert with_deny == netns.firewall_rules(netns.parse_network(["10.0.0.0/8"]), [])


@pytest.mark.parametrize(("entry", "words"), [
    ("!dns.google", "host names"), ("!8.8.8.8:53", "no port"), ("!10.0.0.1/8", "host bits"),
    ("!", "!CIDR")])
def test_bad_deny_entries(entry, words):
    with pytest.raises(RuntimeShimError) as e:
        netns.parse_network(["public", entry])
    assert words in (e.value.message + (e.value.hint or "")) and "\n" not in e.value.message
