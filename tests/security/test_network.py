"""Issue 11 item 6: ``network=True`` must mean egress, not the host.

Attacks reproduced against real runc + slirp4netns (and QEMU for the microVM): reading a host
service on ``127.0.0.1`` (directly, through the slirp gateway ``10.0.2.2``, through the host's
own interface address), finding a host abstract unix socket, binding a port the host then
talks to, seeing the host's interfaces. The one destination a sandbox may reach is a "remote"
host the test makes itself: a network namespace behind a veth pair, addressed in the
benchmarking range 198.18.0.0/15. Nothing else but loopback is ever a target here.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import netns
from runtime_shim.sdk.sandbox import Sandbox, gc_sandboxes
from tests.conftest import require_root, require_tool
from tests.security.netsite import http_servers, veth_namespace

REMOTE_HOST_SIDE = "198.18.0.1"
REMOTE_ADDR = "198.18.0.2"


@pytest.fixture(autouse=True)
def _tools():
    require_root()
    for tool in ("runc", "slirp4netns", "iptables-restore", "nsenter", "unshare", "ip", "ss"):
        require_tool(tool)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"host-secret\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(addr: str, port: int) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer((addr, port), _Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _host_address() -> str:
    """The host's own non-loopback address (eth0's here), where a 0.0.0.0 service listens."""
    addrs = [a for a in netns.host_local_addresses() if not a.startswith("198.18.")]
    assert addrs, "the host has no non-loopback IPv4 address to test with"
    return addrs[0]


@pytest.fixture
def host_services():
    """An HTTP server on host loopback and one on the host's interface address."""
    port = _free_port()
    lo = _serve("127.0.0.1", port)
    eth = _serve(_host_address(), port)
    # The attack's precondition: both answer from the host.
    for addr in ("127.0.0.1", _host_address()):
        with socket.create_connection((addr, port), timeout=2):
            pass
    yield port
    lo.shutdown()
    eth.shutdown()
    lo.server_close()
    eth.server_close()


@pytest.fixture
def remote_host():
    """A "remote" host in a network namespace the test makes (veth, 198.18.0.2/30) with an
    HTTP server on two ports; everything is removed afterwards, and checked to be gone."""
    ports = (_free_port(), _free_port())
    with veth_namespace("remote", [(f"{REMOTE_HOST_SIDE}/30", f"{REMOTE_ADDR}/30")]) as ns, \
            http_servers(ns, REMOTE_ADDR, ports, b"remote-ok\n"):
        yield ports


def _create(busybox_store, **kw) -> Sandbox:
    store, node = busybox_store
    return Sandbox.create("env/busybox-shell", store=store, node_dir=node, **kw)


def _wget(sb: Sandbox, addr: str, port: int) -> tuple[int, str]:
    # No -T: busybox 1.35 wget segfaults with it; refused connections fail at once anyway.
    r = sb.exec(f"wget -q -O - http://{addr}:{port}/", timeout=20)
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


def _slirp_pids_for(path: str) -> list[int]:
    """slirp4netns processes with an argument containing ``path``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"slirp4netns") and \
                    any(path.encode() in a for a in argv):
                found.append(int(p.name))
    return found


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def test_host_loopback_interfaces_and_ports_unreachable(busybox_store, host_services,
                                                        remote_host):
    port = host_services
    with _create(busybox_store, network=True) as sb:
        ns_file = str(sb.paths.root / "netns")
        # The remote host is reachable: network=True is egress.
        code, out = _wget(sb, REMOTE_ADDR, remote_host[0])
        assert code == 0 and "remote-ok" in out, out
        # The host is not: its loopback, directly and through slirp's gateway, and its own
        # interface address (where 0.0.0.0 services listen).
        for addr in ("127.0.0.1", netns.SLIRP_GATEWAY, _host_address(), REMOTE_HOST_SIDE):
            code, out = _wget(sb, addr, port)
            assert code != 0 and "host-secret" not in out, (addr, out)
        # Only the sandbox's own interfaces.
        links = sb.exec("ip -o link").stdout.decode()
        assert sorted(line.split(":")[1].strip() for line in links.splitlines()) == \
            ["lo", "tap0"]
        dev = sb.exec("cat /proc/net/dev").stdout.decode().splitlines()[2:]
        assert sorted(line.split(":")[0].strip() for line in dev) == ["lo", "tap0"]
        # The sandbox has no way to change its firewall or routes: no CAP_NET_ADMIN, not even
        # in its bounding set, nor as root of a new user namespace (which does not own the
        # network namespace).
        status = sb.exec("grep -E 'CapEff|CapBnd' /proc/self/status").stdout.decode()
        for field in ("CapEff:", "CapBnd:"):
            assert not int(status.split(field)[1].split()[0], 16) & (1 << 12)  # CAP_NET_ADMIN
        for attack in ("ip link set tap0 down", "ip route del default",
                       "ip addr add 192.0.2.2/32 dev lo",
                       "unshare -U -r ip route del default"):
            r = sb.exec(attack, timeout=20)
            # "not permitted" from the kernel, or (once user namespaces are refused by the
            # seccomp profile) unshare failing
            assert r.exit_code != 0, (attack, r)
            assert b"not permitted" in (r.stdout + r.stderr).lower(), (attack, r)
        code, out = _wget(sb, REMOTE_ADDR, remote_host[0])
        assert code == 0 and "remote-ok" in out, out  # routes and tap0 unchanged
        assert _slirp_pids_for(ns_file) and _mounted(ns_file)
    assert not _slirp_pids_for(ns_file)
    assert not _mounted(ns_file) and not Path(ns_file).exists()


def test_port_bound_in_sandbox_unreachable_from_host(busybox_store):
    with _create(busybox_store, network=True) as sb:
        lport = _free_port()
        r = sb.exec(f"(nc -l -p {lport} </dev/null >/dev/null 2>&1 &) ; sleep 0.3; "
                    "netstat -ltn", timeout=20)
        assert f":{lport}" in r.stdout.decode(), r.stdout  # it listens, in the sandbox
        ss = subprocess.run(["ss", "-Hltn", f"sport = :{lport}"], capture_output=True,
                            text=True, check=True).stdout
        assert ss.strip() == "", ss
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", lport), timeout=2).close()


def test_host_abstract_unix_socket_invisible(busybox_store):
    name = f"eb-net-test-{uuid.uuid4().hex[:8]}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind("\0" + name)
        s.listen()
        assert name in Path("/proc/net/unix").read_text()  # the host sees it
        with _create(busybox_store, network=True) as sb:
            r = sb.exec("cat /proc/net/unix")
            assert r.exit_code == 0
            assert name not in r.stdout.decode()


def test_resolv_conf_and_host_ca_bundle(busybox_store):
    with _create(busybox_store, network=True) as sb:
        assert sb.read_file("/etc/resolv.conf").decode().split()[:2] == ["nameserver",
                                                                          "10.0.2.3"]
        env = sb.exec("env").stdout.decode()
        assert "SSL_CERT_FILE=/.envbuild/host-ca.crt" in env
        assert "PIP_CERT=/.envbuild/host-ca.crt" in env
        ca = sb.exec("head -c 64 /.envbuild/host-ca.crt").stdout
        assert ca == Path("/etc/ssl/certs/ca-certificates.crt").read_bytes()[:64]


def test_allow_list(busybox_store, remote_host, host_services):
    good, other = remote_host
    with _create(busybox_store, network=[f"{REMOTE_ADDR}/32:{good}"]) as sb:
        code, out = _wget(sb, REMOTE_ADDR, good)
        assert code == 0 and "remote-ok" in out, out
        code, out = _wget(sb, REMOTE_ADDR, other)
        assert code != 0 and "remote-ok" not in out, out
        code, out = _wget(sb, "127.0.0.1", host_services)
        assert code != 0 and "host-secret" not in out
    # An allow-list naming another destination blocks the remote host entirely.
    with _create(busybox_store, network=[f"198.19.0.0/16:{good}"]) as sb:
        code, out = _wget(sb, REMOTE_ADDR, good)
        assert code != 0 and "remote-ok" not in out, out


@pytest.mark.parametrize("entry, words", [
    ("300.1.2.3/8", "300.1.2.3/8"),
    ("10.0.0.0/8:99999", "port"),
    ("pypi.org:443", "host names are not allowed"),
    ("127.0.0.1:80", "never reachable"),
    ("10.0.2.2/32", "never reachable"),
    ("10.0.0.1/8", "host bits"),
])
def test_allow_list_errors_are_one_line(busybox_store, entry, words):
    store, node = busybox_store
    before = set(os.listdir(node / "sandboxes")) if (node / "sandboxes").exists() else set()
    with pytest.raises(RuntimeShimError) as e:
        _create(busybox_store, network=[entry])
    assert words in e.value.message and "\n" not in e.value.message
    assert e.value.hint
    after = set(os.listdir(node / "sandboxes")) if (node / "sandboxes").exists() else set()
    assert after == before  # refused before anything was made


def test_cli_allow_error(envbuild_cli):
    r = envbuild_cli("run", "--allow", "nope", "busybox-shell", "true")
    assert r.code == 1
    lines = r.err.strip().splitlines()
    assert lines[0].startswith("error: network allow-list entry 'nope'"), r.err
    assert len(lines) == 2 and lines[1].startswith("hint: "), r.err
    assert "Traceback" not in r.err


def test_crashed_creator_leaves_nothing_after_gc(busybox_store):
    """A creator killed with SIGKILL: slirp exits with it (--exit-fd); gc removes the
    namespace file and the sandbox."""
    store, node = busybox_store
    code = textwrap.dedent(f"""
        import sys, time
        from envbuild.store import LocalStore
        from runtime_shim.sdk.sandbox import Sandbox
        sb = Sandbox.create("env/busybox-shell", store=LocalStore({str(store.root)!r}),
                            node_dir={str(node)!r}, network=True)
        from runtime_shim.sdk import exitwatch
        exitwatch.stop()  # a crash its watcher dies in too: gc removes what is left
        print(sb.id, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    sandbox_id = child.stdout.readline().strip()
    assert sandbox_id.startswith("eb-"), sandbox_id
    ns_file = str(node / "sandboxes" / sandbox_id / "netns")
    assert _slirp_pids_for(ns_file)
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 5
    while _slirp_pids_for(ns_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _slirp_pids_for(ns_file)  # died with its owner
    assert _mounted(ns_file)
    assert sandbox_id in gc_sandboxes(node)
    assert not _mounted(ns_file) and not (node / "sandboxes" / sandbox_id).exists()


def test_kept_sandbox_keeps_network_until_removed(busybox_store, remote_host):
    """``envbuild run --keep --network``: slirp outlives the CLI process (no exit fd) so the
    kept sandbox keeps its network; ``remove_sandbox`` from another process stops it by the
    recorded pid."""
    from runtime_shim.sdk.sandbox import remove_sandbox

    store, node = busybox_store
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node), "ENVBUILD_STORE": str(store.root),
           "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "envbuild.cli", "run", "--keep", "--network",
                           "env/busybox-shell", "true"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    sandbox_id = proc.stderr.split("sandbox ")[1].split()[0]
    root = node / "sandboxes" / sandbox_id
    ns_file = str(root / "netns")
    try:
        pids = _slirp_pids_for(ns_file)
        assert len(pids) == 1
        record = json.loads((root / "netns.json").read_text())
        assert record["version"] == netns.NETNS_RECORD_VERSION and record["slirp_pid"] == pids[0]
        sb = Sandbox.attach(sandbox_id, store=store, node_dir=node)
        code, out = _wget(sb, REMOTE_ADDR, remote_host[0])
        assert code == 0 and "remote-ok" in out, out
    finally:
        remove_sandbox(node, sandbox_id)
    assert not _slirp_pids_for(ns_file) and not _mounted(ns_file) and not root.exists()


def test_teardown_never_kills_a_pid_that_is_not_its_slirp(tmp_path):
    (tmp_path / "netns").touch()
    (tmp_path / "netns.json").write_text(json.dumps(
        {"version": 1, "netns": str(tmp_path / "netns"), "slirp_pid": os.getpid()}))
    netns.teardown(tmp_path)  # a reused pid (ours): left alone
    assert sorted(os.listdir(tmp_path)) == []
    netns.teardown(tmp_path)  # idempotent: nothing recorded, nothing to do


def test_teardown_refuses_unknown_record_versions(tmp_path):
    (tmp_path / "netns.json").write_text('{"version": 99}')
    with pytest.raises(RuntimeShimError, match="unknown version 99"):
        netns.teardown(tmp_path)


def test_microvm_gateway_is_not_host_loopback(busybox_store, host_services, remote_host):
    """QEMU's user-mode NIC maps the guest's 10.0.2.2 to the loopback of the namespace QEMU
    runs in: with QEMU in the sandbox's own namespace that is empty, not the host's."""
    for tool in ("qemu-system-x86_64", "mkfs.erofs", "mkfs.ext4"):
        require_tool(tool)
    from runtime_shim.sdk.sandbox import Limits

    with _create(busybox_store, backend="microvm", network=True,
                 limits=Limits(memory_bytes=384 << 20)) as sb:
        qemu_pid = sb.host_pid
        assert os.readlink(f"/proc/{qemu_pid}/ns/net") != os.readlink("/proc/self/ns/net")
        ns_file = str(sb.paths.root / "netns")
        assert os.stat(f"/proc/{qemu_pid}/ns/net").st_ino == os.stat(ns_file).st_ino
        code, out = _wget(sb, netns.SLIRP_GATEWAY, host_services)
        assert code != 0 and "host-secret" not in out, out
        code, out = _wget(sb, _host_address(), host_services)
        assert code != 0 and "host-secret" not in out, out
        code, out = _wget(sb, REMOTE_ADDR, remote_host[0])
        assert code == 0 and "remote-ok" in out, out
    assert not _slirp_pids_for(ns_file) and not _mounted(ns_file)


def test_build_step_network_is_egress_not_the_host(envbuild_cli, host_services, remote_host):
    """A run step of a (hostile) definition with network on: the remote host answers, host
    loopback, the slirp gateway and the host's own address do not."""
    port = host_services
    out = "/opt/toolkits/shtest"
    fetch = " ; ".join(
        f"wget -q -O {out}/{name} http://{addr}:{p}/ 2>/dev/null || echo refused >{out}/{name}"
        for name, addr, p in (("lo", "127.0.0.1", port), ("gw", netns.SLIRP_GATEWAY, port),
                              ("eth", _host_address(), port),
                              ("remote", REMOTE_ADDR, remote_host[0])))
    kit = envbuild_cli.defs / "toolkits" / "shtest.yaml"
    kit.write_text(kit.read_text().replace(
        "steps:\n", f"steps:\n  - run: 'mkdir -p {out} ; {fetch}'\n", 1))
    r = envbuild_cli("build")
    assert r.code == 0, r.err
    r = envbuild_cli("run", "busybox-shell", "sh", "-c",
                     f"cd {out} && for f in lo gw eth remote; do echo $f=$(cat $f); done")
    assert r.code == 0, r.err
    got = dict(line.split("=", 1) for line in r.out.split())
    assert got == {"lo": "refused", "gw": "refused", "eth": "refused", "remote": "remote-ok"}, got
    assert not _slirp_pids_for(str(envbuild_cli.node))  # the steps' slirps are gone
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if str(envbuild_cli.node) in line.split()[4]]
