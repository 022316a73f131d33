"""The sandbox exec agent (PID 1 of every sandbox) over real runc: protocol, process groups,
backpressure, users, reaping, and who may connect. The protocol is runtime_shim/isolation/agent/README.md."""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import agent, cbuild
from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.conftest import require_tool
from tests.integration.conftest import build_busybox_env

ENV = "busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="module")
def sb(built):
    """One sandbox shared by the tests that leave it as they found it."""
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sandbox:
        yield sandbox


def _create(built, **kw) -> Sandbox:
    store, node = built
    return Sandbox.create(ENV, store=store, node_dir=node, **kw)


def _connect(sandbox: Sandbox) -> socket.socket:
    return sandbox.handle._connect()


def _frames(sock: socket.socket, until: set[int], timeout: float = 10) -> list[tuple[int, bytes]]:
    """Read frames until one of type ``until`` (inclusive) or EOF."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while True:
        while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
            n = int.from_bytes(buf[1:5], "big")
            out.append((buf[0], buf[5:5 + n]))
            buf = buf[5 + n:]
            if out[-1][0] in until:
                return out
        data = sock.recv(1 << 16)
        if not data:
            return out
        buf += data


def _processes(sandbox: Sandbox) -> list[tuple[int, str, str]]:
    """(pid, state, comm) of every process in the sandbox, from /proc."""
    r = sandbox.exec("for f in /proc/[0-9]*/stat; do cat $f 2>/dev/null; echo; done")
    procs = []
    for line in r.stdout.decode().splitlines():
        m = re.match(r"(\d+) \((.*)\) (\S)", line)
        if m:
            procs.append((int(m[1]), m[3], m[2]))
    return procs


def _wait_gone(sandbox: Sandbox, comm: str, seconds: float = 5) -> list:
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in _processes(sandbox) if p[2] == comm]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_binary_output_and_stdin_round_trip(sb):
    data = bytes(range(256)) * (12 << 12)  # all byte values, 12 MiB
    r = sb.exec(["cat"], stdin=data)
    assert r.exit_code == 0 and not r.output_truncated
    assert r.stdout == data
    r = sb.exec("cat >&2", stdin=data[: 3 << 20])
    assert r.stderr == data[: 3 << 20] and r.stdout == b""
    sb.write_file("/tmp/blob", data[: 5 << 20])
    assert sb.exec(["cat", "/tmp/blob"]).stdout == data[: 5 << 20]


def test_large_stdin_to_a_command_that_reads_it_or_not(sb):
    big = os.urandom(1 << 20) * 20
    assert sb.exec(["wc", "-c"], stdin=big).stdout.split() == [str(len(big)).encode()]
    started = time.monotonic()
    r = sb.exec(["true"], stdin=big)  # never reads: the rest is dropped, no hang
    assert r.exit_code == 0 and time.monotonic() - started < 10
    r = sb.exec("head -c 10", stdin=big)
    assert r.stdout == big[:10]


def test_many_sequential_execs_are_fast(sb):
    times = []
    for i in range(200):
        t = time.perf_counter()
        r = sb.exec(["echo", str(i)])
        times.append(time.perf_counter() - t)
        assert r.stdout == f"{i}\n".encode()
    assert statistics.median(times) < 0.02, statistics.median(times)  # runc exec: ~25 ms


def test_concurrent_execs_in_one_sandbox(sb):
    def one(i):
        r = sb.exec(f"sleep 0.0{i % 10}; echo out-{i}; echo err-{i} >&2; exit {i % 7}")
        return i, r

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    for i, r in results:
        assert (r.exit_code, r.stdout, r.stderr) == (i % 7, f"out-{i}\n".encode(),
                                                     f"err-{i}\n".encode())


def test_a_background_child_holding_stdout_does_not_hold_the_exec(sb):
    """Decision: an exec ends when the command exits. Output the command wrote is all
    delivered; a background process it left (still holding stdout) keeps running, and what it
    prints later is read and discarded by the agent, so it never dies of SIGPIPE."""
    started = time.monotonic()
    r = sb.exec("rm -f /tmp/alive; (sleep 0.5; echo late; echo alive > /tmp/alive) & "
                "head -c 300000 /dev/zero; echo early")
    assert time.monotonic() - started < 3
    assert r.exit_code == 0
    assert r.stdout == b"\0" * 300000 + b"early\n"
    deadline = time.monotonic() + 5
    while sb.exec("cat /tmp/alive").stdout != b"alive\n":
        assert time.monotonic() < deadline, "the background process did not survive its write"
        time.sleep(0.1)


def test_kill_frame_kills_the_whole_process_group(sb):
    with _connect(sb) as sock:
        req = agent.ExecRequest(argv=("sh", "-c", "sleep 1000 & sleep 1000 & echo up; wait"))
        sock.sendall(agent.encode_request(req) + agent.frame(agent.T_STDIN_EOF))
        assert (agent.R_STDOUT, b"up\n") in _frames(sock, {agent.R_STDOUT})
        deadline = time.monotonic() + 5  # forked, but maybe not yet exec'd
        while len([p for p in _processes(sb) if p[2] == "sleep"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.sendall(agent.frame(agent.T_KILL, (9).to_bytes(4, "big")))
        kind, payload = _frames(sock, {agent.R_EXIT})[-1]
        assert kind == agent.R_EXIT
        code, flags, sig = int.from_bytes(payload[:4], "big"), payload[4], payload[5]
        assert (code, flags & agent.F_SIGNALED, sig) == (137, agent.F_SIGNALED, 9)
    assert _wait_gone(sb, "sleep") == []


def test_timeout_and_output_cap_kill_grandchildren_too(built):
    with _create(built, limits=Limits(output_bytes=1 << 16)) as s:
        r = s.exec("sleep 1000 & sleep 1000 & sleep 1000", timeout=0.5)
        assert r.timed_out and r.exit_code == 124
        assert _wait_gone(s, "sleep") == []
        r = s.exec("sleep 1000 & yes", timeout=30)
        assert r.output_truncated and len(r.stdout) == 1 << 16
        assert _wait_gone(s, "sleep") == []


def test_user_switching(sb):
    r = sb.exec("id -u; id -g; id -G", user="1000:1000")
    assert r.stdout == b"1000\n1000\n1000\n"
    assert sb.exec(["id", "-u"], user="1234").stdout == b"1234\n"
    assert sb.exec(["id", "-u"]).stdout == b"0\n"  # the lock's user
    with pytest.raises(RuntimeShimError, match="not numeric"):
        sb.exec(["id"], user="nobody")
    status = sb.exec("grep -E 'CapEff|NoNewPrivs' /proc/self/status", user="1000:1000").stdout
    assert b"CapEff:\t0000000000000000" in status and b"NoNewPrivs:\t1" in status
    # files written by root in a 1777 tmpfs are not the user's
    sb.exec("echo secret > /tmp/root-only && chmod 600 /tmp/root-only")
    assert sb.exec("cat /tmp/root-only", user="1000:1000").exit_code != 0


def test_start_failures_look_like_a_shell(sb):
    r = sb.exec(["no-such-command", "x"])
    assert r.exit_code == 127 and b"no-such-command: No such file or directory" in r.stderr
    sb.exec("printf 'x' > /tmp/not-exec && chmod 644 /tmp/not-exec")
    r = sb.exec(["/tmp/not-exec"])
    assert r.exit_code == 126 and b"Permission denied" in r.stderr
    r = sb.exec(["true"], cwd="/no/such/dir")
    assert r.exit_code == 125 and b"chdir /no/such/dir" in r.stderr
    assert sb.exec("echo fine").stdout == b"fine\n"


def test_agent_survives_a_client_that_disconnects_mid_command(sb):
    for _ in range(3):
        sock = _connect(sb)
        req = agent.ExecRequest(argv=("sh", "-c", "echo up; sleep 1000"))
        sock.sendall(agent.encode_request(req) + agent.frame(agent.T_STDIN_EOF)
                     + agent.frame(agent.T_STDIN, b"half a req"))
        assert (agent.R_STDOUT, b"up\n") in _frames(sock, {agent.R_STDOUT})
        sock.close()  # the command dies with the connection
        assert _wait_gone(sb, "sleep") == []
    # a half-sent request, and garbage
    for junk in (agent.frame(agent.T_HELLO, (1).to_bytes(4, "big"))[:7], b"\xff" * 100):
        sock = _connect(sb)
        sock.sendall(junk)
        sock.close()
    assert sb.exec("echo still-serving").stdout == b"still-serving\n"


def test_protocol_errors_are_answered_not_fatal(sb):
    with _connect(sb) as sock:
        sock.sendall(agent.frame(agent.T_HELLO, (99).to_bytes(4, "big")))
        kind, msg = _frames(sock, {agent.R_ERROR})[-1]
        assert kind == agent.R_ERROR and b"unsupported protocol version 99" in msg
    with _connect(sb) as sock:
        sock.sendall(agent.frame(agent.T_HELLO, (1).to_bytes(4, "big"))
                     + agent.frame(agent.T_START))
        assert _frames(sock, {agent.R_ERROR})[-1][0] == agent.R_ERROR
    with _connect(sb) as sock:
        sock.sendall(agent.frame(agent.T_HELLO, (1).to_bytes(4, "big"))
                     + b"\x02" + (2 << 20).to_bytes(4, "big"))
        assert b"over the" in _frames(sock, {agent.R_ERROR})[-1][1]
    assert sb.exec(["true"]).ok


def test_the_agent_reaps_every_zombie(sb):
    for _ in range(30):
        sb.exec("sleep 0.01 & sleep 0.02 & true")  # orphans, reparented to the agent
        sb.exec(["true"])
    time.sleep(0.3)
    procs = _processes(sb)
    assert [p for p in procs if p[1] == "Z"] == []
    assert procs[0][:1] == (1,) and procs[0][2] == "envbuild-agent"


def test_processes_in_the_sandbox_cannot_use_the_agent(built):
    with _create(built) as s:
        # the socket is not in the sandbox (tests/security/test_exec_channel.py attacks that)
        assert s.exec("ls /.envbuild/run").exit_code != 0
        # a process in the sandbox's pid namespace (here: the host's python entered into it)
        # is refused even though it can reach the socket
        code = ("import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                f"s.connect({str(s.paths.agent_socket)!r})\n"
                "s.settimeout(5)\n"
                "try:\n"
                "    s.sendall(bytes([1, 0, 0, 0, 4, 0, 0, 0, 1]))\n"
                "    sys.stdout.write(repr(s.recv(100)))\n"
                "except (BrokenPipeError, ConnectionResetError):\n"
                "    sys.stdout.write('refused')\n")
        if shutil.which("nsenter") is None:
            pytest.fail("nsenter (util-linux) is missing")
        out = subprocess.run(["nsenter", "-t", str(s.host_pid), "-p", "--",
                              sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0 and out.stdout in ("b''", "refused"), out


def test_agent_binary_is_built_once_and_errors_are_clear(tmp_path, monkeypatch):
    require_tool("gcc")
    first = agent.agent_binary(tmp_path)
    assert first == agent.agent_binary(tmp_path)
    assert first.parent.parent == tmp_path / "agent" and os.access(first, os.X_OK)
    out = subprocess.run([str(first), "--version"], capture_output=True, text=True)
    assert out.stdout == f"envbuild-agent protocol {agent.PROTOCOL_VERSION}\n"
    assert [p.name for p in first.parent.iterdir()] == ["envbuild-agent"]  # no temp left

    monkeypatch.setattr(cbuild.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeShimError, match="gcc is not installed") as e:
        agent.agent_binary(tmp_path / "other")
    assert "libc6-dev" in e.value.hint
    monkeypatch.undo()

    broken = tmp_path / "agent.c"
    broken.write_text("int main(void) { return undefined_thing; }\n")
    monkeypatch.setattr(agent, "SOURCE", broken)
    agent._source_key.cache_clear()
    try:
        with pytest.raises(RuntimeShimError, match="gcc exited") as e:
            agent.agent_binary(tmp_path / "broken")
        assert "undefined_thing" in e.value.context
        assert not any((tmp_path / "broken" / "agent").rglob("*envbuild-agent*"))
    finally:
        agent._source_key.cache_clear()


def test_binding_agent_sockets_from_many_threads_leaves_the_umask_alone(tmp_path):
    """listen_socket must not touch the process-wide umask: concurrent creates (AsyncSandbox
    runs them on executor threads) once raced on it and left the process at umask 0177."""
    import stat
    from concurrent.futures import ThreadPoolExecutor

    before = os.umask(0o022)
    os.umask(before)
    dirs = [tmp_path / f"d{i}" for i in range(32)]
    for d in dirs:
        d.mkdir()

    def bind(d):
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
        try:
            agent.listen_socket(fd).close()
        finally:
            os.close(fd)
        return stat.S_IMODE(os.stat(d / "agent.sock").st_mode)

    with ThreadPoolExecutor(8) as pool:
        modes = list(pool.map(bind, dirs))
    after = os.umask(0o022)
    os.umask(after)
    assert after == before
    assert set(modes) == {0o600}
