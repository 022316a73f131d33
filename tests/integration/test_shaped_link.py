"""The benchmark's shaped link really shapes: the rate is capped, every request pays the added
latency, and nothing of the namespace, veth or proxy outlives it (benchmarks/shaped_link.py)."""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, require_root, require_tool

pytestmark = pytest.mark.integration
sys.path.insert(0, str(REPO / "benchmarks"))

from _stats import process_cpu  # noqa: E402
from shaped_link import LinkProfile, ShapedLink  # noqa: E402


def test_profiles_parse_and_bad_ones_say_what_is_expected():
    p = LinkProfile.parse("1gbit:10ms")
    assert (p.rate_bits, p.latency_s) == (10**9, 0.01)
    assert LinkProfile.parse("10gbit:2ms").rate_bits == 10 * 10**9
    assert not LinkProfile.parse("loopback").shaped
    with pytest.raises(ValueError, match="RATE:LATENCY"):
        LinkProfile.parse("1gbit")


def test_a_shaped_link_caps_the_rate_adds_latency_per_request_and_leaves_nothing(tmp_path: Path):
    require_root()
    for tool in ("ip", "tc"):
        require_tool(tool)
    (tmp_path / "big").write_bytes(b"\0" * (6 * 10**6))
    (tmp_path / "small").write_bytes(b"x")
    profile = LinkProfile.parse("40mbit:20ms")
    with ShapedLink(profile) as link:
        link.run_server([sys.executable, "-m", "http.server", "--bind", link.server_ip, "8765",
                         "-d", str(tmp_path)], 8765, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
        host = link.endpoint(8765).removeprefix("http://")
        cpu0 = process_cpu(link.pids)
        conn = http.client.HTTPConnection(host, timeout=30)
        t = time.perf_counter()
        conn.request("GET", "/big")
        assert len(conn.getresponse().read()) == 6 * 10**6
        mbit = 6 * 8 / (time.perf_counter() - t)
        # the benchmark's "store CPU": both processes started (cpu0), then copied 6 MB
        assert process_cpu(link.pids) > cpu0 > 0.0
        # 48 Mbit at 40 Mbit/s: ~1.2 s; unshaped loopback would take milliseconds
        assert 25 < mbit < 44, f"{mbit:.0f} Mbit/s through a 40 Mbit/s link"
        conn = http.client.HTTPConnection(host, timeout=30)  # http.server closes after each
        times = []
        for _ in range(5):
            conn = http.client.HTTPConnection(host, timeout=30)
            t = time.perf_counter()
            conn.request("GET", "/small")
            conn.getresponse().read()
            times.append(time.perf_counter() - t)
        assert min(times) >= 0.019, f"requests took {times}: the 20 ms latency is missing"
        netns, veth, pids = link.netns, link.host_if, link.pids
        assert len(pids) == 2  # the server and its proxy
        assert netns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True).stdout
    assert netns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True).stdout
    assert subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode != 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} outlived the link"
    assert process_cpu(pids) == 0.0   # processes gone count nothing (no error)
