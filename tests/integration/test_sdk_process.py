"""``AsyncSandbox.start``: commands that outlive the call that started them (issue 37 item 2)
— stdin written while they run and closed, signals, kill, wait, beside other execs; bounded
stdin; hanging up or closing the sandbox ends them. Real runc sandboxes of the busybox env."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim import AsyncSandbox
from tests.integration.conftest import build_busybox_env

ENV = "busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdkproc"))


def _run(built, scenario):
    store, node = built

    async def main():
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node)
        try:
            return await scenario(sb)
        finally:
            await sb.close()

    return asyncio.run(main())


def test_stdin_is_written_while_the_command_runs(built):
    async def scenario(sb):
        out: list[bytes] = []
        proc = await sb.start("while read line; do echo got:$line; done; echo eof",
                              on_stdout=out.append)
        proc.write_stdin(b"one\n")
        deadline = time.monotonic() + 10
        while b"".join(out) != b"got:one\n" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert b"".join(out) == b"got:one\n" and not proc.done  # answered, still running
        proc.write_stdin("two\n")
        proc.close_stdin()
        result = await proc.wait()
        assert (result.exit_code, result.stdout) == (0, b"got:one\ngot:two\neof\n")
        with pytest.raises(RuntimeShimError, match="stdin is closed"):
            proc.write_stdin(b"late")

    _run(built, scenario)


def test_signals_kill_and_execs_beside_it(built):
    async def scenario(sb):
        term = await sb.start("trap 'echo term; exit 7' TERM; echo up; "
                              "while :; do sleep 0.05; done")
        sleeper = await sb.start(["sleep", "100"])
        assert (await sb.exec("echo beside")).stdout == b"beside\n"
        await asyncio.sleep(0.3)
        term.send_signal(signal.SIGTERM)
        result = await term.wait()
        assert (result.exit_code, result.stdout) == (7, b"up\nterm\n")
        started = time.monotonic()
        sleeper.kill()
        killed = await sleeper.wait()
        assert killed.exit_code == 128 + signal.SIGKILL and time.monotonic() - started < 5
        assert (await sb.exec("ps -o comm | grep -c '^sleep$' || true")).stdout == b"0\n"

    _run(built, scenario)


def test_unread_stdin_is_bounded_and_a_hang_up_ends_the_command(built):
    async def scenario(sb):
        proc = await sb.start(["sleep", "100"])  # never reads stdin
        with pytest.raises(RuntimeShimError, match="unread"):
            for _ in range(64):
                proc.write_stdin(b"x" * (64 << 10))
                await asyncio.sleep(0)
        await proc.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = (await sb.exec("ps -o comm | grep -c '^sleep$' || true")).stdout
            if left == b"0\n":
                break
            await asyncio.sleep(0.05)
        assert left == b"0\n"

    _run(built, scenario)


def test_a_timeout_ends_it_and_says_so(built):
    async def scenario(sb):
        proc = await sb.start("sleep 100", timeout=0.5)
        result = await proc.wait()
        assert result.timed_out and result.exit_code != 0

    _run(built, scenario)


def test_sync_process_stdin_signals_and_wait(built):
    from runtime_shim import Sandbox

    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        out: list[bytes] = []
        proc = sb.start("while read line; do echo got:$line; done; echo eof",
                        on_stdout=out.append)
        proc.write_stdin(b"one\n")
        deadline = time.monotonic() + 10
        while b"".join(out) != b"got:one\n" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b"".join(out) == b"got:one\n" and not proc.done
        with pytest.raises(TimeoutError):
            proc.wait(timeout=0.1)  # still running: it waits for stdin
        assert sb.exec("echo beside").stdout == b"beside\n"
        proc.write_stdin("two\n")
        proc.close_stdin()
        result = proc.wait(timeout=10)
        assert (result.exit_code, result.stdout) == (0, b"got:one\ngot:two\neof\n")
        with pytest.raises(RuntimeShimError, match="stdin is closed"):
            proc.write_stdin(b"late")

        term = sb.start("trap 'echo term; exit 7' TERM; echo up; while :; do sleep 0.05; done")
        time.sleep(0.3)
        term.send_signal(signal.SIGTERM)
        assert (term.wait(10).exit_code, term.wait().stdout) == (7, b"up\nterm\n")
        sleeper = sb.start(["sleep", "100"])
        sleeper.kill()
        assert sleeper.wait(10).exit_code == 128 + signal.SIGKILL
