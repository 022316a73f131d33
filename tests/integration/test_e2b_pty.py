"""Conformance, PTYs: the unmodified ``e2b`` SDK's ``sandbox.pty`` (create, send_stdin,
stream_input, resize, connect, kill, wait; sync and async) against ``envbuild serve`` with
real runc sandboxes of the busybox env (issue 37 items 1 and 5). Modelled on E2B's own
``packages/python-sdk/tests/{sync,async}/sandbox_*/pty`` tests (``tput`` is ``stty size``
here: busybox has no ``tput``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.e2b_server import TEMPLATE
from tests.pty_screen import Screen

pytestmark = pytest.mark.slow


def _pump(handle, screen: Screen) -> threading.Thread:
    """Iterate a sync handle's events in a thread (the sync SDK delivers output only while
    something iterates it), feeding ``screen``; the thread ends with the command."""
    def run() -> None:
        for _stdout, _stderr, pty in handle:
            if pty is not None:
                screen.feed(pty)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_pty_create_env_cwd_and_exit_code(e2b_sandbox):
    from e2b import CommandExitException
    from e2b.sandbox.commands.command_handle import PtySize

    terminal = e2b_sandbox.pty.create(PtySize(24, 80), envs={"ABC": "123"}, cwd="/tmp")
    e2b_sandbox.pty.send_stdin(terminal.pid, b"echo $ABC; pwd; [ -t 0 ] && tty; echo $TERM\n"
                                         b"exit\n")
    output: list[bytes] = []
    result = terminal.wait(on_pty=output.append)
    text = b"".join(output).decode()
    assert result.exit_code == 0
    assert "123\r\n/tmp\r\n/dev/pts/" in text and "xterm-256color\r\n" in text
    failing = e2b_sandbox.pty.create(PtySize(24, 80))
    e2b_sandbox.pty.send_stdin(failing.pid, b"exit 3\n")
    with pytest.raises(CommandExitException) as e:
        failing.wait()
    assert e.value.exit_code == 3


def test_pty_resize_stream_input_and_ctrl_c(e2b_sandbox):
    from e2b.sandbox.commands.command_handle import PtySize

    screen = Screen()
    terminal = e2b_sandbox.pty.create(PtySize(24, 80))
    pump = _pump(terminal, screen)
    e2b_sandbox.pty.send_stdin(terminal.pid, b"stty size\n")
    screen.wait_for(b"\n24 80\r\n")
    e2b_sandbox.pty.resize(terminal.pid, PtySize(rows=40, cols=100))
    e2b_sandbox.pty.send_stdin(terminal.pid, b"stty size\n")
    screen.wait_for(b"\n40 100\r\n")
    e2b_sandbox.pty.stream_input(terminal.pid, [b"echo stre", "amed\n"])
    screen.wait_for(b"\nstreamed\r\n")
    e2b_sandbox.pty.send_stdin(terminal.pid, b"sleep 100; echo slept\n")
    time.sleep(0.3)
    started = time.monotonic()
    e2b_sandbox.pty.send_stdin(terminal.pid, b"\x03")
    e2b_sandbox.pty.send_stdin(terminal.pid, b"echo after $?\n")
    screen.wait_for(b"after 130\r\n")
    assert time.monotonic() - started < 5 and b"slept" not in screen.data
    e2b_sandbox.pty.send_stdin(terminal.pid, b"exit\n")
    pump.join(15)
    assert not pump.is_alive() and terminal.wait().exit_code == 0


def test_pty_connect_and_kill(e2b_sandbox):
    from e2b import CommandExitException
    from e2b.sandbox.commands.command_handle import PtySize

    terminal = e2b_sandbox.pty.create(PtySize(24, 80), envs={"ABC": "123"})
    screen = Screen()
    connected = e2b_sandbox.pty.connect(terminal.pid)
    assert connected.pid == terminal.pid
    pump = _pump(connected, screen)
    e2b_sandbox.pty.send_stdin(terminal.pid, b"echo $ABC-seen\n")
    screen.wait_for(b"\n123-seen\r\n")
    assert e2b_sandbox.pty.kill(terminal.pid) is True
    with pytest.raises(CommandExitException) as e:
        terminal.wait()
    assert e.value.exit_code == 137
    pump.join(15)
    assert not pump.is_alive()
    assert e2b_sandbox.pty.kill(999999) is False
    with pytest.raises(CommandExitException):  # (E2B's test: the pid is not a process)
        e2b_sandbox.commands.run(f"kill -0 {terminal.pid}")


def test_pty_misuse_is_refused_in_one_line(e2b_sandbox):
    from e2b import SandboxException
    from e2b.sandbox.commands.command_handle import PtySize

    with pytest.raises(SandboxException, match="rows and cols must be whole numbers"):
        e2b_sandbox.pty.create(PtySize(5000, 80))
    plain = e2b_sandbox.commands.run("sleep 30", background=True, stdin=True)
    with pytest.raises(SandboxException, match="pty input for a process without a PTY"):
        e2b_sandbox.pty.send_stdin(plain.pid, b"x")
    with pytest.raises(SandboxException, match="has no PTY to resize"):
        e2b_sandbox.pty.resize(plain.pid, PtySize(24, 80))
    terminal = e2b_sandbox.pty.create(PtySize(24, 80))
    with pytest.raises(SandboxException, match="stdin input for a PTY process"):
        e2b_sandbox.commands.send_stdin(terminal.pid, "x")
    with pytest.raises(SandboxException, match="rows and cols must be whole numbers"):
        e2b_sandbox.pty.resize(terminal.pid, PtySize(24, 70000))
    e2b_sandbox.pty.kill(terminal.pid)
    e2b_sandbox.commands.kill(plain.pid)


def test_async_pty_create_input_resize_connect_kill(e2b_server):
    from e2b import AsyncSandbox
    from e2b.sandbox.commands.command_handle import PtySize

    async def main() -> None:
        sb = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            out: list[bytes] = []
            terminal = await sb.pty.create(PtySize(24, 80), on_data=out.append,
                                           envs={"ABC": "123"})
            seen: list[bytes] = []
            connected = await sb.pty.connect(terminal.pid, on_data=seen.append)
            await sb.pty.resize(terminal.pid, PtySize(rows=33, cols=101))
            await sb.pty.send_stdin(terminal.pid, b"echo $ABC; stty size\n")
            await sb.pty.send_stdin(terminal.pid, b"exit\n")
            result = await terminal.wait()
            assert result.exit_code == 0
            text = b"".join(out)
            assert b"\n123\r\n33 101\r\n" in text
            await connected.wait()
            assert b"\n123\r\n33 101\r\n" in b"".join(seen)
            sleeper = await sb.pty.create(PtySize(24, 80), on_data=lambda _: None)
            assert await sb.pty.kill(sleeper.pid) is True
            assert not await sb.pty.kill(999999)
        finally:
            await sb.kill()

    asyncio.run(main())
