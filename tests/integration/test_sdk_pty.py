"""PTYs (``Sandbox.start(..., pty=(rows, cols))``, agent protocol 2, issue 37): a real ``sh`` on
a terminal in a real runc sandbox of the busybox env — it is a tty and its controlling one,
``stty size`` follows ``resize`` (and the foreground job gets SIGWINCH), ^C interrupts a
foreground ``sleep`` and the shell carries on, a kill reaches the terminal's foreground job,
the exit code comes back; bad sizes and a resize without a PTY are refused in one line; an
agent built from the protocol-1 source refuses a PTY in one line and still runs plain execs."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim import AsyncSandbox, Sandbox
from runtime_shim.isolation import agent, cbuild
from tests.conftest import require_tool
from tests.integration.conftest import build_busybox_env
from tests.pty_screen import Screen

ENV = "busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdkpty"))


@pytest.fixture(scope="module")
def sb(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sandbox:
        yield sandbox


def test_a_command_on_a_pty_has_a_controlling_terminal_and_its_exit_code(sb):
    screen = Screen()
    proc = sb.start("[ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-ttys; tty; "
                    "cat /proc/self/stat | cut -d' ' -f7; echo term=$TERM; exit 3",
                    pty=(24, 80), on_stdout=screen.feed)
    result = proc.wait(30)
    text = result.stdout.decode()
    assert result.exit_code == 3 and proc.pty == (24, 80)
    assert "all-ttys\r\n" in text  # the terminal's line discipline turns \n into \r\n
    assert re.search(r"^/dev/pts/\d+\r$", text, re.M), text
    tty_nr = int(re.search(r"^(\d+)\r$", text, re.M)[1])
    assert tty_nr != 0  # stat's tty_nr: the terminal is its controlling tty
    assert "term=xterm-256color\r\n" in text and result.stderr == b""
    assert screen.data == result.stdout  # the stream and the result agree


def test_stty_size_follows_resize_and_the_foreground_job_gets_sigwinch(sb):
    screen = Screen()
    proc = sb.start("sh", pty=(24, 80), on_stdout=screen.feed, env={"PS1": "$ "})
    proc.write_stdin("stty size\r")
    screen.wait_for(rb"\n24 80\r\n")
    proc.resize(40, 120)
    proc.write_stdin("stty size\r")
    screen.wait_for(rb"\n40 120\r\n")
    # a foreground job of its own group (job control) sees the change as SIGWINCH
    proc.write_stdin("sh -c 'trap \"echo winch; exit 0\" WINCH; echo armed; "
                     "while :; do sleep 0.05; done'; echo job $?\r")
    screen.wait_for(rb"\narmed\r\n")
    proc.resize(50, 132)
    screen.wait_for(rb"^winch\r\njob 0\r\n")
    proc.write_stdin("exit\r")
    assert proc.wait(30).exit_code == 0


def test_ctrl_c_interrupts_a_foreground_sleep_and_the_shell_carries_on(sb):
    screen = Screen()
    proc = sb.start("sh", pty=(24, 80), on_stdout=screen.feed, env={"PS1": "$ "})
    proc.write_stdin("sleep 100; echo slept $?\r")
    time.sleep(0.3)
    started = time.monotonic()
    proc.write_stdin(b"\x03")
    proc.write_stdin("echo after $?\r")
    screen.wait_for(rb"after 130\r\n")
    assert time.monotonic() - started < 5 and b"slept" not in screen.data
    proc.write_stdin("exit 4\r")
    assert proc.wait(30).exit_code == 4
    assert sb.exec("ps -o comm | grep -c '^sleep$' || true").stdout == b"0\n"


def test_a_kill_reaches_the_terminals_foreground_job(sb):
    screen = Screen()
    proc = sb.start("sh", pty=(24, 80), on_stdout=screen.feed, env={"PS1": "$ "})
    proc.write_stdin("echo ready; sleep 123\r")
    screen.wait_for(rb"\nready\r\n")
    time.sleep(0.2)
    proc.kill()
    assert proc.wait(30).exit_code == 128 + signal.SIGKILL
    deadline = time.monotonic() + 5
    while sb.exec("ps -o args | grep -c '^sleep 123' || true").stdout != b"0\n":
        assert time.monotonic() < deadline, "the foreground sleep outlived the kill"
        time.sleep(0.05)


def test_async_pty_and_output_past_the_cap_is_streamed(built):
    store, node = built

    async def main():
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node)
        try:
            out: list[bytes] = []
            cap = sb.sync.limits.output_bytes
            # twice the cap: a terminal is a stream, not killed at the cap; the result keeps
            # at most the first cap bytes and says it was truncated
            proc = await sb.start(f"head -c {2 * cap} /dev/zero | tr '\\0' x; echo; "
                                  "stty size; exit 9", pty=(30, 100), on_stdout=out.append)
            result = await proc.wait()
            data = b"".join(out)
            assert result.exit_code == 9 and data.endswith(b"\r\n30 100\r\n")
            assert data.count(b"x") == 2 * cap
            # (at most cap: a frame is charged at least FRAME_CHARGE bytes of it)
            assert result.output_truncated and cap // 2 < len(result.stdout) <= cap
            assert data.startswith(result.stdout)
        finally:
            await sb.close()

    asyncio.run(main())


def test_bad_sizes_and_a_resize_without_a_pty_are_refused(sb):
    for size in [(0, 80), (24, 0), (4097, 80), (24, 5000)]:
        with pytest.raises(RuntimeShimError, match="rows and cols must be"):
            sb.start("true", pty=size)
    proc = sb.start("sh", pty=(24, 80))
    with pytest.raises(RuntimeShimError, match="rows and cols must be"):
        proc.resize(70000, 80)
    proc.kill()
    proc.wait(30)
    plain = sb.start("cat")
    with pytest.raises(RuntimeShimError, match="needs a command started with pty"):
        plain.resize(24, 80)
    plain.close_stdin()
    assert plain.wait(30).exit_code == 0


def test_the_agent_refuses_out_of_range_sizes_itself(sb):
    """A host that skipped the checks gets the agent's ERROR, not a terminal."""
    bad = agent.frame(agent.T_PTY, (0).to_bytes(2, "big") + (80).to_bytes(2, "big"))
    sock = sb.handle._connect()
    try:
        sock.sendall(agent.frame(agent.T_HELLO, (2).to_bytes(4, "big"))
                     + agent.frame(agent.T_ARG, b"true") + bad + agent.frame(agent.T_START))
        reply = _read_all(sock)
    finally:
        sock.close()
    assert bytes([agent.R_ERROR]) in reply and b"PTY needs protocol 2" in reply


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_an_agent_of_protocol_1_refuses_a_pty_in_one_line(tmp_path):
    """The agent as it was before PTYs (git: the protocol-1 source), run on a socket of its
    own: a PTY request gets one clear line; a plain exec still works (it asks for 1)."""
    require_tool("gcc")
    require_tool("git")
    old = subprocess.run(["git", "show", "d759fee:runtime_shim/isolation/agent/agent.c"],
                         capture_output=True, check=True).stdout
    assert b"#define PROTO_VERSION 1u" in old
    (tmp_path / "agent.c").write_bytes(old)
    binary = cbuild.static_binary(tmp_path / "cache", tmp_path / "agent.c", "old-agent",
                                  "protocol-1", "the protocol-1 agent")
    path = str(tmp_path / "a.sock")
    proc = subprocess.Popen([str(binary), "--listen", path, "--any-peer"])
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "a.sock").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)

        def connect() -> socket.socket:
            return agent.connect_agent(path)

        plain = agent.run(connect, agent.ExecRequest(argv=("echo", "v1")), 1 << 20)
        assert (plain.exit_code, plain.stdout) == (0, b"v1\n")
        with pytest.raises(RuntimeShimError) as e:
            agent.run(connect, agent.ExecRequest(argv=("sh",), pty=(24, 80)), 1 << 20)
        assert "cannot run a PTY (it speaks protocol 1, PTYs need 2)" in e.value.message
        assert "\n" not in e.value.message and "older envbuild" in (e.value.hint or "")
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_users_terminal_is_the_users(sb):
    """As login does: the terminal of a command run as a user is owned by that user, so the
    command can open it by path (``echo > $(tty)``), and a hang-up kills the foreground job."""
    proc = sb.start("t=$(tty); ls -ln $t | awk '{print $3}'; echo mine > $t; id -u",
                    pty=(24, 80), user="1000:1000")
    result = proc.wait(30)
    assert (result.exit_code, result.stdout) == (0, b"1000\r\nmine\r\n1000\r\n"), result


def test_a_hang_up_ends_the_terminals_foreground_job(built):
    store, node = built

    async def main():
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node)
        try:
            out: list[bytes] = []
            proc = await sb.start("sh", pty=(24, 80), on_stdout=out.append, env={"PS1": "$ "})
            # the job ignores SIGHUP, so only the agent's kill of the foreground group ends it
            proc.write_stdin("trap '' HUP; echo ready; sleep 321\r")
            deadline = time.monotonic() + 10
            while b"\nready\r\n" not in b"".join(out):
                assert time.monotonic() < deadline, b"".join(out)
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            await proc.cancel()  # the host hangs up
            deadline = time.monotonic() + 5
            while (await sb.exec("ps -o args | grep -c '^sleep 321' || true")).stdout != b"0\n":
                assert time.monotonic() < deadline, "the foreground sleep outlived the hang-up"
                await asyncio.sleep(0.05)
        finally:
            await sb.close()

    asyncio.run(main())
