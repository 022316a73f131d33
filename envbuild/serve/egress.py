"""E2B's egress rules mapped onto envbuild's firewall (pure): the body of
``PUT /sandboxes/{id}/network`` (``envbuild.serve.control_net``) and the ``network`` /
``allow_internet_access`` fields of a create.

E2B's rules are ``allowOut`` (addresses, CIDRs or host names), ``denyOut`` (addresses or
CIDRs; ``0.0.0.0/0`` is all traffic) and ``allow_internet_access`` (false = deny all), where an
allowed entry always wins over a denied one and an update replaces every rule (an omitted
field is cleared). envbuild's firewall (``runtime_shim.isolation.netns``: ``Sandbox.set_network``)
knows ``public`` (the internet, never the host nor the private ranges), an allow-list of
``CIDR[:PORT]`` and deny entries ``!CIDR`` taken out of ``public`` (the allow-list wins over
them). ``e2b_network`` maps one onto the other:

- all traffic denied (``0.0.0.0/0`` or ``allow_internet_access: false``): ``allowOut`` only,
  and with nothing allowed ``False``: not even DNS;
- else ``["public", *allowOut, *("!" + each denyOut)]`` (an allowed private CIDR opens it;
  a denied one inside what ``public`` refuses anyway changes nothing).

What the firewall cannot express is refused with one line (``NetworkRefused``, E2B's 400):
a host name in ``allowOut`` (the firewall matches addresses; a name resolves differently over
time and per resolver), IPv6, per-host ``rules``
(header transforms), an ``egressProxy``, public ports (``allowPublicTraffic: true``: every
port request needs the sandbox's token), ``maskRequestHost`` and ``httpsPorts``.
``dnsServers`` is accepted and has no effect: on E2B it only matters for host names in
``allowOut``. With an allow-list, DNS to the sandbox's own resolver stays open (envbuild's
allow-lists always allow it); only "deny all, allow nothing" closes it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from envbuild.errors import EnvbuildError
from runtime_shim.isolation import netns

#: A sandbox's ``network=`` for ``runtime_shim``: a bool or a list of destinations.
Network = bool | list[str]
ALL_TRAFFIC = ipaddress.IPv4Network("0.0.0.0/0")
#: The create's and the update's key for internet access (E2B's spec spells it so there;
#: ``SandboxDetail`` says ``allowInternetAccess``).
ACCESS = "allow_internet_access"


class NetworkRefused(EnvbuildError):
    """An E2B network rule envbuild's firewall cannot express (E2B's 400)."""

    def line(self) -> str:
        """The 400's message: the cause and the hint on one line."""
        return self.message + (f" ({self.hint})" if self.hint else "")


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NetworkRefused(f"{what} must be a list of strings")
    return value


def _allow(entry: str) -> str:
    try:
        return str(netns.parse_allow(entry))
    except EnvbuildError as e:
        raise NetworkRefused(f"allowOut: {e.message}", hint="give IPv4 addresses or CIDRs "
                             "(envbuild's firewall matches addresses, not host names)") from None


def _deny(entry: str) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(entry.strip(), strict=False)
    except ValueError:
        raise NetworkRefused(f"denyOut entry {entry!r} is not an IPv4 address or CIDR",
                             hint="denyOut takes addresses (as on E2B)") from None


def _check_unsupported(config: Mapping[str, Any]) -> None:
    if config.get("egressProxy") is not None:
        raise NetworkRefused("egressProxy: envbuild does not tunnel egress through a proxy")
    if config.get("rules"):
        raise NetworkRefused("rules: envbuild's firewall has no per-host request transforms")
    if config.get("allowPublicTraffic") is True:
        raise NetworkRefused("allowPublicTraffic: a port of an envbuild sandbox always needs "
                             "its traffic access token")
    if config.get("maskRequestHost") is not None:
        raise NetworkRefused("maskRequestHost: port hosts are always PORT-ID.localhost:PORT")
    if config.get("httpsPorts"):
        raise NetworkRefused("httpsPorts: the server reaches a sandbox's ports over plain HTTP")


def e2b_network(config: Mapping[str, Any], allow_internet_access: Any = None) -> Network:
    """E2B's network ``config`` (``SandboxNetworkConfig`` or ``SandboxNetworkUpdateConfig``,
    camelCase as on the wire) and ``allow_internet_access`` → ``Sandbox.set_network``'s
    argument (module docstring); ``NetworkRefused`` for what cannot be expressed."""
    if not isinstance(config, Mapping):
        raise NetworkRefused("network must be an object")
    if allow_internet_access is not None and not isinstance(allow_internet_access, bool):
        raise NetworkRefused(f"{ACCESS} must be true or false")
    _check_unsupported(config)
    _strings(config.get("dnsServers"), "dnsServers")
    allow = [_allow(e) for e in _strings(config.get("allowOut"), "allowOut")]
    deny = [_deny(e) for e in _strings(config.get("denyOut"), "denyOut")]
    if ALL_TRAFFIC in deny or allow_internet_access is False:
        return allow or False
    return [netns.PUBLIC, *allow, *(f"{netns.DENY}{n}" for n in deny)]


def create_network(body: Mapping[str, Any]) -> Network | None:
    """The network of a sandbox created with E2B's create ``body``: None (none at all, as
    before this module) unless it says what the sandbox may reach (``allow_internet_access``,
    or ``allowOut``/``denyOut`` in ``network``); ``NetworkRefused`` as ``e2b_network``."""
    config = body.get("network") or {}
    access = body.get(ACCESS)
    if not isinstance(config, Mapping):
        raise NetworkRefused("network must be an object")
    network = e2b_network(config, access)
    if access is None and config.get("allowOut") is None and config.get("denyOut") is None:
        return None
    return network


def described(network: Network | None) -> dict[str, Any]:
    """The ``network`` and ``allowInternetAccess`` of ``GET /sandboxes/{id}`` for a sandbox
    whose firewall was last set to ``network`` (None: it has no network)."""
    if network is None:
        return {}
    entries = [] if network is True else list(network or ())
    public = network is True or netns.PUBLIC in entries
    deny = [e[len(netns.DENY):] for e in entries if e.startswith(netns.DENY)] if public \
        else [str(ALL_TRAFFIC)]
    return {"allowInternetAccess": public,
            "network": {"allowOut": [e for e in entries if e != netns.PUBLIC
                                     and not e.startswith(netns.DENY)],
                        **({"denyOut": deny} if deny else {})}}
