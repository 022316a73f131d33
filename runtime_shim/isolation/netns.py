"""A sandbox's own network: a named network namespace, user-mode NAT, a firewall.

``network=True`` must mean egress, not the host. Sharing the host's network namespace gave a
sandbox the host's ``127.0.0.1`` services, its ports, interfaces and abstract unix sockets. So a
networked sandbox (container or the QEMU process of a microVM) gets instead:

- its own network namespace, bind-mounted on a file in the sandbox's directory
  (``<dir>/netns``) so runc (``{"type": "network", "path": …}``) and ``nsenter`` can join it.
  Abstract unix sockets and every port bound inside live in that namespace only;
- ``slirp4netns`` (Debian 1.2.0) attached to it as ``tap0``: user-mode NAT, outbound
  connections are made by the slirp process from the host's namespace, nothing listens on the
  host. It runs with ``--disable-host-loopback`` (the gateway ``10.0.2.2`` is not the host's
  loopback), ``--enable-sandbox`` and ``--enable-seccomp``; start-up waits on ``--ready-fd``
  and, unless the sandbox outlives its creator (``keep``), ``--exit-fd`` makes slirp exit when
  the process that created it does;
- a firewall in the namespace (``iptables-restore``, installed before slirp starts and before
  any sandbox process exists; sandbox processes have no ``CAP_NET_ADMIN`` to change it, see
  ``runtime_shim.isolation.spec``), stateless, in this order:

  1. the namespace's loopback: allowed;
  2. DNS to slirp's forwarder ``10.0.2.3`` (and to the host's own resolvers on port 53, which
     that forwarder queries anyway, for QEMU's inner slirp), unless the policy closes DNS;
  3. refused whatever the policy: the slirp network ``10.0.2.0/24`` (its gateway is the
     host) and every address the host owns when the rules are written (``ip route show table
     local``: a service on ``0.0.0.0`` listens on them);
  4. the allow-list entries: allowed;
  5. with ``public``, the policy's ``deny`` entries (``!CIDR``: a part of the internet this
     sandbox may not reach, e.g. one service's addresses): refused; then the node's own
     additions (``NodeNetwork``): refused its networks of
     ``$ENVBUILD_NETWORK_REFUSE`` (e.g. the cluster's addresses, public ones too), allowed its
     private package mirrors of ``$ENVBUILD_NETWORK_MIRRORS`` (``CIDR[:PORT]``, e.g. an apt
     or PyPI mirror on ``10.x``); then refused the private and special ranges (``PRIVATE``:
     RFC 1918, CGNAT ``100.64.0.0/10``, link-local, loopback, ``0/8``, multicast and
     reserved); then anything else allowed: the public internet, where the package registries
     are;
  6. everything else refused.

  A private destination (a package mirror on ``10.x``, a service of the task) is therefore
  reachable only when an allow-list entry names it. IPv6: slirp4netns runs without
  ``--enable-ipv6`` and an ``ip6tables`` firewall refuses everything but the namespace's
  loopback (QEMU's inner slirp would otherwise try IPv6 from the namespace), so ULA and every
  other IPv6 destination are unreachable.

A policy is written as ``network=``: ``True`` (``["public"]``), or a list of destinations:
``"public"``, allow-list entries ``CIDR[:PORT]`` (``"10.0.0.0/8:443"``, ``"198.18.0.7"`` =
``/32``, any port; a port allows TCP and UDP to it) and deny entries ``"!CIDR"`` (taken out of
``public``; an allow-list entry still wins over them). ``[]`` allows DNS only. Host names are
refused: a name resolves differently over time and per resolver, so an allow-list of names is
not a boundary. Entries inside the loopback or slirp networks are refused (never reachable);
an entry covering a host address does not open it (rule 3 comes first).

The rules can be replaced while the sandbox runs (``update``: one ``iptables-restore``
transaction in the namespace, e.g. the package index open during setup and closed while an
agent works). The firewall keeps no connection state, so the new rules apply to every packet
sent after ``update`` returns: new connections, and packets of connections opened before it
to a destination now refused (those fail).

Everything the namespace owns is recorded in ``<dir>/netns.json`` (versioned; version 2 adds
the policy in force and the node's additions, which ``update`` from another process keeps)
before it is made, so ``teardown(dir)`` can remove the leftovers of a crashed creator: it
kills the slirp process it recorded (only if that pid is still slirp4netns on this namespace
file), unmounts the namespace file and removes the files. Teardown is idempotent.

Planning (``parse_network``, ``NodeNetwork.from_env``, ``firewall_rules``, ``resolv_conf``)
is pure; ``create``, ``update`` and ``teardown`` do the side effects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from envbuild.safefs import read_tail
from runtime_shim.isolation.mount import unmount  # at the top: teardown runs at interpreter exit too

NETNS_RECORD_VERSION = 2
#: Record versions ``teardown`` and ``update`` read (1: before the policy was recorded).
READABLE_RECORD_VERSIONS = (1, 2)
SLIRP_NETWORK = ipaddress.IPv4Network("10.0.2.0/24")
SLIRP_GATEWAY = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"
TAP = "tap0"
MTU = 65520
#: How long ``create`` waits for slirp4netns to configure ``tap0``.
READY_TIMEOUT = 10.0
NEVER_ALLOWED = (ipaddress.IPv4Network("127.0.0.0/8"), SLIRP_NETWORK)
ALWAYS_REFUSED = (SLIRP_NETWORK,)
#: Refused to ``public`` egress unless an allow-list entry names them: not the internet but a
#: site's own networks (another host's services, the fleet's cluster, cloud metadata).
PRIVATE = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8",        # "this network"
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",    # CGNAT (RFC 6598): a provider's or a VPN's internal hosts
    "127.0.0.0/8",      # loopback (the namespace's own lo is allowed before this)
    "169.254.0.0/16",   # link-local, cloud metadata endpoints
    "224.0.0.0/4", "240.0.0.0/4",  # multicast, reserved and broadcast
))
#: The word for the public internet in a ``network=`` list.
PUBLIC = "public"
#: The mark of a deny entry in a ``network=`` list: ``"!CIDR"``.
DENY = "!"
#: The node's own refused networks (comma-separated CIDRs), e.g. the cluster's addresses.
REFUSE_ENV = "ENVBUILD_NETWORK_REFUSE"
#: The node's private package mirrors (comma-separated ``CIDR[:PORT]``), part of ``public``.
MIRRORS_ENV = "ENVBUILD_NETWORK_MIRRORS"

NS_FILE = "netns"
RECORD_FILE = "netns.json"
LOG_FILE = "slirp.log"
RESOLV_FILE = "resolv.conf"


@dataclasses.dataclass(frozen=True)
class Allow:
    """One allow-list entry: a destination network and an optional port (TCP and UDP)."""

    network: ipaddress.IPv4Network
    port: int | None = None

    def __str__(self) -> str:
        return f"{self.network}" + (f":{self.port}" if self.port is not None else "")


@dataclasses.dataclass(frozen=True)
class NetworkPolicy:
    """What a networked sandbox may reach: the public internet (``public``: anything but the
    host and the private ranges), the ``allow`` entries (private ones included), DNS."""

    public: bool = True
    allow: tuple[Allow, ...] = ()
    dns: bool = True
    deny: tuple[ipaddress.IPv4Network, ...] = ()  # out of ``public`` (``allow`` still wins)

    def entries(self) -> list[str]:
        """The ``network=`` list that parses back to this policy (DNS aside)."""
        return (([PUBLIC] if self.public else []) + [str(a) for a in self.allow]
                + [f"{DENY}{n}" for n in self.deny])


#: ``set_network(False)``: nothing at all leaves the namespace, not even DNS.
CLOSED = NetworkPolicy(public=False, allow=(), dns=False)

_HINT = (f"write {PUBLIC!r} or CIDR[:PORT], e.g. 10.0.0.0/8:443 or 198.18.0.7 "
         "(addresses only, no names)")


def parse_allow(entry: str) -> Allow:
    """``"CIDR[:PORT]"`` → ``Allow``; a one-line ``RuntimeShimError`` for anything else."""
    if not isinstance(entry, str) or not entry.strip():
        raise RuntimeShimError(f"network allow-list entry {entry!r} is empty or not a string",
                               hint=_HINT)
    text = entry.strip()
    if text.count(":") > 1 or text.startswith("["):
        raise RuntimeShimError(f"network allow-list entry {entry!r}: IPv6 destinations are "
                               "not supported (a sandbox's network is IPv4 only)", hint=_HINT)
    addr, sep, port_s = text.rpartition(":") if ":" in text else (text, "", "")
    port: int | None = None
    if sep:
        if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
            raise RuntimeShimError(f"network allow-list entry {entry!r}: port {port_s!r} is "
                                   "not a number from 1 to 65535", hint=_HINT)
        port = int(port_s)
    try:
        network = ipaddress.IPv4Network(addr, strict=True)
    except ValueError as e:
        what = "host names are not allowed" if any(c.isalpha() for c in addr) else str(e)
        raise RuntimeShimError(f"network allow-list entry {entry!r}: {what}",
                               hint=_HINT) from None
    for never in NEVER_ALLOWED:
        if network.subnet_of(never):
            raise RuntimeShimError(f"network allow-list entry {entry!r}: {never} is never "
                                   "reachable from a sandbox (the host's loopback or slirp "
                                   "network)", hint=_HINT)
    return Allow(network, port)


def parse_deny(entry: str) -> ipaddress.IPv4Network:
    """``"!CIDR"`` → the network; a one-line ``RuntimeShimError`` for anything else."""
    text = entry.strip()[len(DENY):].strip()
    try:
        return ipaddress.IPv4Network(text, strict=True)
    except ValueError as e:
        what = ("host names are not allowed" if any(c.isalpha() for c in text) else
                "a deny entry has no port" if ":" in text else str(e))
        raise RuntimeShimError(f"network deny entry {entry!r}: {what}",
                               hint="write !CIDR, e.g. !198.51.100.0/24 or !203.0.113.9") from None


def parse_network(network: bool | Sequence[str] | None) -> NetworkPolicy | None:
    """The ``network=`` option of a sandbox → a policy, or None for no network at all.

    ``False``/``None``: an empty namespace; ``True``: the public internet (``["public"]``); a
    list of ``"public"``, ``CIDR[:PORT]`` and ``"!CIDR"`` entries: egress to those only, the
    ``!`` ones taken out of ``public`` (an empty list allows only DNS)."""
    if network is None or network is False:
        return None
    if network is True:
        return NetworkPolicy()
    if isinstance(network, (str, bytes)) or not isinstance(network, Sequence):
        raise RuntimeShimError(f"network={network!r} is neither a bool nor a list of "
                               "destinations", hint=_HINT)
    def kind(e: object) -> str:
        text = e.strip() if isinstance(e, str) else ""
        return "public" if text == PUBLIC else "deny" if text.startswith(DENY) else "allow"

    return NetworkPolicy(public=any(kind(e) == "public" for e in network),
                         allow=tuple(parse_allow(e) for e in network if kind(e) == "allow"),
                         deny=tuple(parse_deny(e) for e in network if kind(e) == "deny"))


@dataclasses.dataclass(frozen=True)
class NodeNetwork:
    """What ``public`` means on this node besides the internet: ``refused`` networks (the
    cluster's addresses) and private ``mirrors`` reached (package mirrors, registries). Read
    from the environment of the process that creates a namespace, then recorded with it."""

    refused: tuple[ipaddress.IPv4Network, ...] = ()
    mirrors: tuple[Allow, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> NodeNetwork:
        """``$ENVBUILD_NETWORK_REFUSE`` and ``$ENVBUILD_NETWORK_MIRRORS``; a one-line
        ``RuntimeShimError`` naming the variable for a bad item."""
        refused, mirrors = [], []
        for item in _items(environ.get(REFUSE_ENV)):
            try:
                refused.append(ipaddress.IPv4Network(item, strict=True))
            except ValueError as e:
                raise RuntimeShimError(f"{REFUSE_ENV}: {item!r} is not an IPv4 network ({e})",
                                       hint="comma-separated CIDRs, e.g. "
                                            "203.0.113.0/24,198.51.100.7") from None
        for item in _items(environ.get(MIRRORS_ENV)):
            try:
                mirrors.append(parse_allow(item))
            except RuntimeShimError as e:
                raise RuntimeShimError(f"{MIRRORS_ENV}: {e.message}", hint=e.hint) from None
        return cls(tuple(refused), tuple(mirrors))

    def to_record(self) -> dict:
        return {"refused": [str(n) for n in self.refused],
                "mirrors": [str(a) for a in self.mirrors]}

    @classmethod
    def from_record(cls, record: Mapping) -> NodeNetwork:
        return cls(tuple(ipaddress.IPv4Network(n) for n in record.get("refused", ())),
                   tuple(parse_allow(a) for a in record.get("mirrors", ())))


def _items(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def firewall_rules(policy: NetworkPolicy, host_addresses: Sequence[str],
                   resolvers: Sequence[str] = (), node: NodeNetwork = NodeNetwork()) -> str:
    """The ``iptables-restore`` input for the sandbox's namespace (pure; the order is the
    module docstring's). REJECT rather than DROP so a refused connection fails at once
    instead of timing out."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT DROP [0:0]",
             "-A OUTPUT -o lo -j ACCEPT"]
    # A resolver the host itself owns stays refused below: DNS then goes through 10.0.2.3.
    for dns in (SLIRP_DNS, *(r for r in resolvers if r not in set(host_addresses))):
        for proto in ("udp", "tcp") if policy.dns else ():
            lines.append(f"-A OUTPUT -d {dns}/32 -p {proto} --dport 53 -j ACCEPT")
    hard = [str(n) for n in ALWAYS_REFUSED] + [f"{a}/32" for a in sorted(set(host_addresses))]
    lines += _reject(hard)
    lines += _accept(policy.allow)
    if policy.public:
        lines += _reject([str(n) for n in policy.deny])
        lines += _reject([str(n) for n in node.refused])
        lines += _accept(node.mirrors)
        lines += _reject([str(n) for n in PRIVATE])
        lines.append(f"-A OUTPUT -o {TAP} -j ACCEPT")
    lines.append("-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset")
    lines.append("-A OUTPUT -j REJECT --reject-with icmp-port-unreachable")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def _accept(entries: Sequence[Allow]) -> list[str]:
    lines = []
    for a in entries:
        if a.port is None:
            lines.append(f"-A OUTPUT -o {TAP} -d {a.network} -j ACCEPT")
        else:
            for proto in ("tcp", "udp"):
                lines.append(f"-A OUTPUT -o {TAP} -d {a.network} -p {proto} "
                             f"--dport {a.port} -j ACCEPT")
    return lines


def _reject(networks: Sequence[str]) -> list[str]:
    lines = []
    for net in networks:
        lines.append(f"-A OUTPUT -d {net} -p tcp -j REJECT --reject-with tcp-reset")
        lines.append(f"-A OUTPUT -d {net} -j REJECT --reject-with icmp-port-unreachable")
    return lines


def firewall6_rules() -> str:
    """The ``ip6tables-restore`` input: nothing but the namespace's loopback (pure)."""
    return "\n".join([
        "*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT DROP [0:0]",
        "-A OUTPUT -o lo -j ACCEPT",
        "-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset",
        "-A OUTPUT -j REJECT --reject-with icmp6-port-unreachable", "COMMIT"]) + "\n"


def resolv_conf() -> str:
    """The sandbox's ``/etc/resolv.conf``: slirp's DNS forwarder (pure)."""
    return f"nameserver {SLIRP_DNS}\noptions edns0\n"


def host_local_addresses() -> tuple[str, ...]:
    """Every IPv4 address the host owns now (its ``local`` routing table), loopback included."""
    done = subprocess.run(["ip", "-j", "-4", "route", "show", "table", "local"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeShimError(f"list host addresses: ip exited {done.returncode}",
                               context=done.stderr.strip() or None,
                               hint="the iproute2 package provides ip")
    found = []
    for route in json.loads(done.stdout or "[]"):
        if route.get("type") == "local" and "dst" in route:
            net = ipaddress.IPv4Network(route["dst"], strict=False)
            if not net.subnet_of(NEVER_ALLOWED[0]):  # the namespace's own lo handles 127/8
                found += [str(a) for a in (net if net.num_addresses <= 256 else [net[0]])]
    return tuple(found)


def host_resolvers(path: str = "/etc/resolv.conf") -> tuple[str, ...]:
    """The host's IPv4 name servers that are not loopback (those slirp's forwarder uses)."""
    found = []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.IPv4Address(parts[1])
            except ValueError:
                continue
            if not addr.is_loopback and not addr.is_link_local and addr not in SLIRP_NETWORK:
                found.append(str(addr))
    return tuple(found)


def host_ca() -> tuple[list, dict[str, str]]:
    """The binds and environment that give a networked sandbox the host's CA bundle, exactly
    as build steps with network get it (``envbuild.build.executor``): the host may reach
    registries through an intercepting proxy only its own bundle trusts."""
    from runtime_shim.isolation.spec import BindMount
    from runtime_shim.isolation.stub import CA_ENV_VARS, HOST_CA_PATH, host_ca_bundle

    ca = host_ca_bundle()
    if ca is None:
        return [], {}
    return [BindMount(ca, HOST_CA_PATH)], {k: HOST_CA_PATH for k in CA_ENV_VARS}


#: Handles this process created and has not closed, by directory: ``teardown`` of one closes
#: its exit fd too, whichever path (close, a failed create, gc) gets there first.
_LIVE: dict[str, NetworkHandle] = {}


class NetworkHandle:
    """A created namespace: ``path`` is the file to join; ``close()`` removes everything."""

    def __init__(self, directory: Path, proc: subprocess.Popen | None,
                 exit_fd: int | None) -> None:
        self.directory = directory
        self.path = str(directory / NS_FILE)
        self.resolv_conf = str(directory / RESOLV_FILE)
        self._proc = proc
        self._exit_fd = exit_fd
        _LIVE[str(directory)] = self

    @property
    def slirp_pid(self) -> int:
        return self._proc.pid if self._proc else 0

    def close(self) -> None:
        """Stop slirp, unmount the namespace file, remove the files. Idempotent."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        if self._proc is not None and self._proc.returncode is None:
            # SIGKILL: slirp has no state worth a clean exit, and it takes ~20 ms to notice its
            # exit fd or SIGTERM. Not reaped yet, so the pid is still ours.
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        _LIVE.pop(str(self.directory), None)
        teardown(self.directory)


def create(directory: str | os.PathLike[str], policy: NetworkPolicy, *,
           outlive_creator: bool = False,
           environ: Mapping[str, str] = os.environ) -> NetworkHandle:
    """Make the namespace under ``directory`` (which must exist), install the firewall, start
    slirp4netns and wait until ``tap0`` is configured. ``outlive_creator``: no exit fd, for
    sandboxes kept after their creator exits (``teardown`` still kills slirp). The node's
    additions come from ``environ`` (``NodeNetwork.from_env``)."""
    d = Path(directory)
    node = NodeNetwork.from_env(environ)
    rules = firewall_rules(policy, host_local_addresses(), host_resolvers(), node)
    ns = d / NS_FILE
    (d / RESOLV_FILE).write_text(resolv_conf())
    _write_record(d, _record(ns, 0, policy, node))
    handle = NetworkHandle(d, None, None)
    try:
        ns.touch(mode=0o600)
        # One process: unshare makes the namespace (bind-mounted on ``ns``) and runs
        # iptables-restore in it, so the firewall is in place before anything else joins.
        _run(["unshare", f"--net={ns}", "--", "iptables-restore"],
             "create the network namespace and its firewall", stdin=rules)
        if os.path.exists("/proc/sys/net/ipv6"):  # still nothing else in the namespace
            _run(["nsenter", f"--net={ns}", "--", "ip6tables-restore"],
                 "install the namespace's IPv6 firewall", stdin=firewall6_rules())
        ready_r, ready_w = os.pipe()
        exit_r, handle._exit_fd = os.pipe() if not outlive_creator else (None, None)
        fds = (ready_w,) + ((exit_r,) if exit_r is not None else ())
        argv = ["slirp4netns", "--configure", f"--mtu={MTU}", "--disable-host-loopback",
                "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_w}",
                *([f"--exit-fd={exit_r}"] if exit_r is not None else []),
                "--netns-type=path", str(ns), TAP]
        try:
            with open(d / LOG_FILE, "wb") as log:
                try:
                    handle._proc = subprocess.Popen(
                        argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True)
                except FileNotFoundError:
                    raise RuntimeShimError("slirp4netns is not installed",
                                           hint="apt-get install slirp4netns "
                                                "(scripts/setup.sh)") from None
            os.close(ready_w)
            ready_w = -1  # slirp holds it now: EOF on ready_r means slirp exited
            _write_record(d, _record(ns, handle._proc.pid, policy, node))
            _wait_ready(ready_r, handle._proc, d / LOG_FILE)
        finally:
            for fd in (ready_r, ready_w, exit_r):
                if fd is not None and fd >= 0:
                    os.close(fd)
    except BaseException:
        handle.close()
        raise
    return handle


def _wait_ready(fd: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            if os.read(fd, 1) == b"1":
                return
            break  # EOF: slirp exited before it was ready
    raise RuntimeShimError("start slirp4netns: not ready" + (
        f" (exited {proc.poll()})" if proc.poll() is not None else
        f" within {READY_TIMEOUT:.0f} s"), context=_tail(log), hint=f"see {log}")


def teardown(directory: str | os.PathLike[str]) -> None:
    """Remove what ``create`` left under ``directory``, whoever created it. Idempotent; a
    directory without a namespace record is fine."""
    d = Path(directory)
    live = _LIVE.get(str(d))
    if live is not None:
        live.close()  # comes back here without the handle
        return
    try:
        record = json.loads((d / RECORD_FILE).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        record = {}
    _check_version(d, record)
    ns = str(d / NS_FILE)
    pid = int(record.get("slirp_pid") or 0)
    if pid > 0 and _is_slirp_for(pid, ns):
        _kill(pid)
    unmount(ns)
    for name in (NS_FILE, RESOLV_FILE, LOG_FILE, RECORD_FILE):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()


def update(directory: str | os.PathLike[str], policy: NetworkPolicy, *,
           environ: Mapping[str, str] = os.environ) -> None:
    """Replace the firewall of the namespace ``create`` made under ``directory`` (from any
    process) by ``policy``'s, in one ``iptables-restore`` transaction: every packet sent after
    this returns obeys it. The node's additions recorded at create are kept (``environ`` gives
    them for a version-1 record). Calls on one directory are serialised."""
    d = Path(directory)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            record = json.loads((d / RECORD_FILE).read_text())
        except FileNotFoundError:
            raise RuntimeShimError(f"{d.name} has no network namespace to change",
                                   hint="a sandbox made with network=[] (DNS only) can be "
                                        "opened later; one made without network= cannot") from None
        _check_version(d, record)
        node = (NodeNetwork.from_record(record) if record.get("version") == NETNS_RECORD_VERSION
                else NodeNetwork.from_env(environ))
        rules = firewall_rules(policy, host_local_addresses(), host_resolvers(), node)
        # nsenter fails on a file that is not a namespace (never the host's firewall)
        _run(["nsenter", f"--net={d / NS_FILE}", "--", "iptables-restore"],
             "change the sandbox's firewall", stdin=rules)
        if not (d / RECORD_FILE).exists():  # torn down meanwhile: leave nothing behind
            raise RuntimeShimError(f"{d.name} was closed while its network was changed")
        _write_record(d, _record(d / NS_FILE, int(record.get("slirp_pid") or 0), policy, node))
    finally:
        os.close(fd)


def _record(ns: Path, slirp_pid: int, policy: NetworkPolicy, node: NodeNetwork) -> dict:
    return {"version": NETNS_RECORD_VERSION, "netns": str(ns), "slirp_pid": slirp_pid,
            "network": policy.entries(), "dns": policy.dns, **node.to_record()}


def _check_version(d: Path, record: dict) -> None:
    if record.get("version", NETNS_RECORD_VERSION) not in READABLE_RECORD_VERSIONS:
        raise RuntimeShimError(f"{d / RECORD_FILE}: unknown version {record.get('version')!r}",
                               hint="remove it with the envbuild that wrote it")


def _is_slirp_for(pid: int, ns: str) -> bool:
    """Whether ``pid`` is still the slirp4netns of namespace file ``ns`` (not a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and os.path.basename(argv[0]) == b"slirp4netns" and ns.encode() in argv


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and wait (up to 2 s) until it is gone: reaped if it is our child, a
    zombie or absent otherwise."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            if state in ("Z", "X"):
                return
        time.sleep(0.005)


def _run(argv: list[str], what: str, stdin: str | None = None) -> None:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise RuntimeShimError(f"{what}: {argv[0]} is not installed",
                               hint="scripts/setup.sh installs the tools sandboxes need") from None
    if done.returncode != 0:
        raise RuntimeShimError(f"{what}: {argv[0]} exited {done.returncode}",
                               context=done.stderr.strip()[-2000:] or None)


def _write_record(d: Path, record: dict) -> None:
    write_atomic(d / RECORD_FILE, json.dumps(record))


def _tail(log: Path) -> str | None:
    try:
        return read_tail(log, 64 * 1024).strip()[-2000:] or None
    except OSError:
        return None
