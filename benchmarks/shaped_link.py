"""A realistic link to a store server: its own network namespace, a rate-limited veth, and a
proxy that adds first-byte latency to every request.

Loopback flatters a full pull (~590 MB/s on this host); a node in a cell pulls over a link it
shares, and every ranged GET a lazy loader makes pays a round trip. This module makes both
visible on one machine:

- ``ip netns add`` a namespace for the server, joined to the host by a veth pair whose two ends
  each carry a token-bucket qdisc (``tc qdisc ... tbf rate R``; this kernel has tbf/htb but not
  netem, so the rate is shaped by the kernel and the latency by the proxy);
- a TCP proxy (``benchmarks/latency_proxy.py``, its own process so it never shares a GIL with
  the code being measured) listens on 127.0.0.1 and forwards to the server in the namespace,
  holding back the first bytes of each new request for the profile's latency.

Profiles are written ``RATE:LATENCY``, e.g. ``1gbit:10ms`` (one node's share of a busy cell)
or ``10gbit:2ms``; ``loopback`` means no namespace and no proxy (today's flattering numbers).

The addresses are a /30 inside the namespace this process made (10.250.X.0/30 with X derived
from the pid): nothing leaves the machine.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_RATE_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """A link's rate (bits/s; 0 = unshaped loopback) and per-request first-byte latency (s)."""

    rate_bits: int
    latency_s: float
    text: str

    @property
    def shaped(self) -> bool:
        return self.rate_bits > 0

    @classmethod
    def parse(cls, text: str) -> LinkProfile:
        if text == "loopback":
            return cls(0, 0.0, text)
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit):(\d+(?:\.\d+)?)(us|ms|s)", text)
        if not m:
            raise ValueError(f"link profile {text!r} is not RATE:LATENCY (e.g. 1gbit:10ms) or "
                             "'loopback'")
        rate = int(float(m[1]) * _RATE_UNITS[m[2]])
        return cls(rate, float(m[3]) * _TIME_UNITS[m[4]], text)

    def __str__(self) -> str:
        if not self.shaped:
            return "loopback (unshaped, no added latency)"
        return (f"{self.text}: {self.rate_bits / 1e6:.0f} Mbit/s token bucket each way, "
                f"{self.latency_s * 1e3:.1f} ms first-byte latency per request")


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ShapedLink:
    """The namespace, the shaped veth and the latency proxy, as a context manager.

    ``run_server(argv, port)`` starts the server inside the namespace, listening on
    ``server_ip:port``; ``endpoint(port)`` is the ``http://127.0.0.1:P`` URL clients use (through
    the proxy). With the ``loopback`` profile both are plain loopback.
    """

    def __init__(self, profile: LinkProfile) -> None:
        self.profile = profile
        tag = os.getpid() % 250
        self.netns = f"ebl-{os.getpid()}"
        self.host_if, self.ns_if = f"eblh{tag}", f"ebln{tag}"
        self.host_ip, self.server_ip = f"10.250.{tag}.1", f"10.250.{tag}.2"
        self._procs: list[subprocess.Popen] = []
        self._proxies: dict[int, int] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> ShapedLink:
        if not self.profile.shaped:
            self.server_ip = "127.0.0.1"
            return self
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)  # a stale one
        try:
            _run("ip", "netns", "add", self.netns)
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _run("ip", "link", "set", self.ns_if, "netns", self.netns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            ns = ("ip", "netns", "exec", self.netns)
            _run(*ns, "ip", "addr", "add", f"{self.server_ip}/30", "dev", self.ns_if)
            _run(*ns, "ip", "link", "set", self.ns_if, "up")
            _run(*ns, "ip", "link", "set", "lo", "up")
            for prefix, dev in (((), self.host_if), (ns, self.ns_if)):
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *self._tbf_args())
        except BaseException:
            self.__exit__()
            raise
        return self

    def _tbf_args(self) -> list[str]:
        rate_bytes = self.profile.rate_bits // 8
        # The bucket must hold at least one timer tick's worth of bytes (HZ <= 1000) and a GSO
        # super-packet (64 KiB), or tbf itself caps the rate below the profile's.
        burst = max(rate_bytes // 500, 128 * 1024)
        return ["rate", str(self.profile.rate_bits), "burst", str(burst), "latency", "50ms"]

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs.clear()
        if self.profile.shaped:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    @property
    def pids(self) -> list[int]:
        """The processes this link started (servers and proxies), killed on exit."""
        return [p.pid for p in self._procs]

    # -- servers ------------------------------------------------------------------------------

    def run_server(self, argv: list[str], port: int, **popen: object) -> subprocess.Popen:
        """Start ``argv`` (listening on ``server_ip:port``) inside the namespace; wait for it."""
        prefix = ["ip", "netns", "exec", self.netns] if self.profile.shaped else []
        proc = subprocess.Popen(prefix + argv, **popen)  # type: ignore[call-overload]
        self._procs.append(proc)
        self._wait_listening(port, proc)
        if self.profile.shaped:
            self._proxies[port] = self._start_proxy(port)
        return proc

    def endpoint(self, port: int) -> str:
        return f"http://127.0.0.1:{self._proxies.get(port, port)}"

    def _wait_listening(self, port: int, proc: subprocess.Popen) -> None:
        prefix = ["ip", "netns", "exec", self.netns] if self.profile.shaped else []
        probe = (f"import socket,sys\ntry:\n socket.create_connection(('{self.server_ip}',{port}),"
                 "timeout=0.2).close()\nexcept OSError:\n sys.exit(1)")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server {proc.args!r} exited with {proc.returncode}")
            if subprocess.run(prefix + [sys.executable, "-c", probe]).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"server {proc.args!r} did not listen on {self.server_ip}:{port}")

    def _start_proxy(self, port: int) -> int:
        listen = _free_port()
        proc = subprocess.Popen([sys.executable, str(HERE / "latency_proxy.py"),
                                 "--listen", f"127.0.0.1:{listen}",
                                 "--target", f"{self.server_ip}:{port}",
                                 "--latency", str(self.profile.latency_s)],
                                stderr=subprocess.DEVNULL)  # asyncio's noise when killed
        self._procs.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=0.2).close()
                return listen
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"latency proxy exited with {proc.returncode}") from None
                time.sleep(0.05)
        raise RuntimeError("latency proxy did not start")
