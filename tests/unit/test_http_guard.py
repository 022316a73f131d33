"""Which addresses a connection off the registry may reach (``envbuild.store._http_guard``)."""

from __future__ import annotations

import pytest

from envbuild.store._http_guard import public


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_public(address):
    assert public(address)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "0.0.0.0", "10.1.2.3", "172.16.0.1", "192.168.1.1",
    "100.64.0.1", "169.254.169.254", "224.0.0.1", "::1", "::", "fc00::1", "fd12::1",
    "fe80::1%eth0", "::ffff:127.0.0.1", "::ffff:10.0.0.1"])
def test_loopback_private_cgnat_link_local_ula_and_mapped_ones_are_not(address):
    assert not public(address)
