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
  ``runtime_shim.spec``): loopback of the namespace allowed; DNS allowed to slirp's forwarder
  ``10.0.2.3`` (and to the host's own resolvers on port 53, which that forwarder queries
  anyway, for QEMU's inner slirp); refused: the slirp network ``10.0.2.0/24`` (its gateway is
  the host), every address the host owns at create time (``ip route show table local``: a
  service on ``0.0.0.0`` listens on them), and link-local ``169.254.0.0/16`` (cloud metadata
  endpoints). Then either any other destination (``network=True``) or only an allow-list.

Allow-list entries are ``CIDR[:PORT]`` (``"10.0.0.0/8:443"``, ``"198.18.0.7"`` = ``/32``, any
port); a port allows TCP and UDP to it. Host names are refused: a name resolves differently
over time and per resolver, so an allow-list of names is not a boundary. Entries inside the
loopback or slirp networks are refused (never reachable); an entry covering a host address
does not open it (the host rules come first). IPv6: slirp4netns runs without ``--enable-ipv6``,
so the namespace has no IPv6 route out.

Everything the namespace owns is recorded in ``<dir>/netns.json`` (versioned) before it is
made, so ``teardown(dir)`` can remove the leftovers of a crashed creator: it kills the slirp
process it recorded (only if that pid is still slirp4netns on this namespace file), unmounts
the namespace file and removes the files. Teardown is idempotent.

Planning (``parse_network``, ``firewall_rules``, ``resolv_conf``) is pure; ``create`` and
``teardown`` do the side effects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from envbuild.errors import RuntimeShimError
from envbuild.safefs import read_tail
from runtime_shim.mount import unmount  # at the top: teardown runs at interpreter exit too

NETNS_RECORD_VERSION = 1
SLIRP_NETWORK = ipaddress.IPv4Network("10.0.2.0/24")
SLIRP_GATEWAY = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"
TAP = "tap0"
MTU = 65520
#: How long ``create`` waits for slirp4netns to configure ``tap0``.
READY_TIMEOUT = 10.0
NEVER_ALLOWED = (ipaddress.IPv4Network("127.0.0.0/8"), SLIRP_NETWORK)
ALWAYS_REFUSED = (SLIRP_NETWORK, ipaddress.IPv4Network("169.254.0.0/16"))

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
    """What a networked sandbox may reach. ``allow`` None: any destination but the host's."""

    allow: tuple[Allow, ...] | None = None


_HINT = "write CIDR[:PORT], e.g. 10.0.0.0/8:443 or 198.18.0.7 (addresses only, no names)"


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


def parse_network(network: bool | Sequence[str] | None) -> NetworkPolicy | None:
    """The ``network=`` option of a sandbox → a policy, or None for no network at all.

    ``False``/``None``: an empty namespace; ``True``: egress to anything but the host; a list
    of ``CIDR[:PORT]``: egress to those only (an empty list allows only DNS)."""
    if network is None or network is False:
        return None
    if network is True:
        return NetworkPolicy()
    if isinstance(network, (str, bytes)) or not isinstance(network, Sequence):
        raise RuntimeShimError(f"network={network!r} is neither a bool nor a list of "
                               "destinations", hint=_HINT)
    return NetworkPolicy(allow=tuple(parse_allow(e) for e in network))


def firewall_rules(policy: NetworkPolicy, host_addresses: Sequence[str],
                   resolvers: Sequence[str] = ()) -> str:
    """The ``iptables-restore`` input for the sandbox's namespace (pure).

    Order matters: the namespace's loopback and DNS first, then what is refused whatever the
    policy (slirp's network, the host's addresses, link-local), then the policy. REJECT rather
    than DROP so a refused connection fails at once instead of timing out."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT DROP [0:0]",
             "-A OUTPUT -o lo -j ACCEPT"]
    # A resolver the host itself owns stays refused below: DNS then goes through 10.0.2.3.
    for dns in (SLIRP_DNS, *(r for r in resolvers if r not in set(host_addresses))):
        for proto in ("udp", "tcp"):
            lines.append(f"-A OUTPUT -d {dns}/32 -p {proto} --dport 53 -j ACCEPT")
    refused = [str(n) for n in ALWAYS_REFUSED]
    refused += [f"{a}/32" for a in sorted(set(host_addresses))]
    for net in refused:
        lines.append(f"-A OUTPUT -d {net} -p tcp -j REJECT --reject-with tcp-reset")
        lines.append(f"-A OUTPUT -d {net} -j REJECT --reject-with icmp-port-unreachable")
    if policy.allow is None:
        lines.append(f"-A OUTPUT -o {TAP} -j ACCEPT")
    else:
        for a in policy.allow:
            if a.port is None:
                lines.append(f"-A OUTPUT -o {TAP} -d {a.network} -j ACCEPT")
            else:
                for proto in ("tcp", "udp"):
                    lines.append(f"-A OUTPUT -o {TAP} -d {a.network} -p {proto} "
                                 f"--dport {a.port} -j ACCEPT")
    lines.append("-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset")
    lines.append("-A OUTPUT -j REJECT --reject-with icmp-port-unreachable")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


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
    from runtime_shim.spec import BindMount
    from runtime_shim.stub import CA_ENV_VARS, HOST_CA_PATH, host_ca_bundle

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
           outlive_creator: bool = False) -> NetworkHandle:
    """Make the namespace under ``directory`` (which must exist), install the firewall, start
    slirp4netns and wait until ``tap0`` is configured. ``outlive_creator``: no exit fd, for
    sandboxes kept after their creator exits (``teardown`` still kills slirp)."""
    d = Path(directory)
    rules = firewall_rules(policy, host_local_addresses(), host_resolvers())
    ns = d / NS_FILE
    (d / RESOLV_FILE).write_text(resolv_conf())
    _write_record(d, {"version": NETNS_RECORD_VERSION, "netns": str(ns), "slirp_pid": 0})
    handle = NetworkHandle(d, None, None)
    try:
        ns.touch(mode=0o600)
        # One process: unshare makes the namespace (bind-mounted on ``ns``) and runs
        # iptables-restore in it, so the firewall is in place before anything else joins.
        _run(["unshare", f"--net={ns}", "--", "iptables-restore"],
             "create the network namespace and its firewall", stdin=rules)
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
            _write_record(d, {"version": NETNS_RECORD_VERSION, "netns": str(ns),
                              "slirp_pid": handle._proc.pid})
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
    if record.get("version", NETNS_RECORD_VERSION) != NETNS_RECORD_VERSION:
        raise RuntimeShimError(f"{d / RECORD_FILE}: unknown version {record.get('version')!r}",
                               hint="remove it with the envbuild that wrote it")
    ns = str(d / NS_FILE)
    pid = int(record.get("slirp_pid") or 0)
    if pid > 0 and _is_slirp_for(pid, ns):
        _kill(pid)
    unmount(ns)
    for name in (NS_FILE, RESOLV_FILE, LOG_FILE, RECORD_FILE):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()


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
    tmp = d / (RECORD_FILE + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(d / RECORD_FILE)


def _tail(log: Path) -> str | None:
    try:
        return read_tail(log, 64 * 1024).strip()[-2000:] or None
    except OSError:
        return None
