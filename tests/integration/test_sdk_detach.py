"""Detached commands (agent protocol 3, issue 37): ``Sandbox.start(..., detachable=True)``,
``Process.detach()`` and ``Sandbox.reattach(id)`` — a command that outlives its connection,
through a CRIU checkpoint and restore too, one that ends while detached, an old agent's
refusal. Real runc sandboxes (and real CRIU) of the busybox env, commands as root."""

from __future__ import annotations

import asyncio
import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim import AsyncSandbox, Sandbox
from tests.integration.conftest import build_busybox_env
from tests.integration.test_checkpoint import require_criu
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

ENV = "env/busybox-shell"
COUNT = "i=0; while :; do echo $i; i=$((i+1)); sleep 0.1; done"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("detach"))


def _numbers(chunks: list[bytes]) -> list[int]:
    return [int(x) for x in b"".join(chunks).split()]


def test_a_detached_command_runs_on_and_is_taken_up_again(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        before: list[bytes] = []
        proc = sb.start(COUNT, detachable=True, on_stdout=before.append)
        wait_for(lambda: len(_numbers(before)) >= 3)
        pid = proc.detach()
        assert isinstance(pid, int) and pid > 0 and proc.done
        with pytest.raises(RuntimeShimError, match="detached"):
            proc.wait(1)
        time.sleep(0.5)  # it counts on, with nobody connected
        after: list[bytes] = []
        again = sb.reattach(pid, on_stdout=after.append)
        wait_for(lambda: len(_numbers(after)) >= 8)
        seen = _numbers(before) + _numbers(after)
        assert seen == list(range(len(seen)))  # nothing lost, nothing twice
        assert again.dropped == 0
        twice = again.detach()  # a reattached command detaches again (the next pause)
        assert twice and twice != pid
        last: list[bytes] = []
        again = sb.reattach(twice, on_stdout=last.append)
        wait_for(lambda: len(_numbers(last)) >= 2)
        again.kill()
        result = again.wait(10)
        assert result.exit_code == 137
        with pytest.raises(RuntimeShimError, match=f"no detached command {pid}"):
            sb.reattach(pid).wait(10)


def test_a_command_that_ends_while_detached_gives_its_exit_on_reattach(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        proc = sb.start("read x; echo got $x; echo err >&2; exit 3", detachable=True)
        pid = proc.detach()
        assert pid
        # stdin stays open across the detach: the reattached process feeds it
        again = sb.reattach(pid)
        again.write_stdin(b"hi\n")
        result = again.wait(10)
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"got hi\n", b"err\n")
        ended = sb.start("echo done; exit 5", detachable=True)
        time.sleep(0.3)
        late = ended.detach()  # it ended before the detach: its result is wait()'s
        if late is None:
            assert ended.wait(5).exit_code == 5
        else:
            assert sb.reattach(late).wait(5).exit_code == 5


def test_detach_needs_a_detachable_start(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        proc = sb.start("sleep 5")
        with pytest.raises(RuntimeShimError, match="detachable=True"):
            proc.detach()
        proc.kill()


def test_a_detached_command_survives_a_checkpoint_and_restore(built):
    """The point of detaching: CRIU cannot dump a connection to the host, so a command on
    one is lost at a memory pause. Detached, it is dumped with the sandbox, counts on after
    the restore, and its output (the part printed across the dump) comes on reattach."""
    require_criu()
    store, node = built

    async def main() -> None:
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node, checkpointable=True)
        try:
            before: list[bytes] = []
            proc = await sb.start(COUNT, detachable=True, on_stdout=before.append)
            while len(_numbers(before)) < 3:
                await asyncio.sleep(0.05)
            pid = await proc.detach()
            assert pid
            await sb.checkpoint("ckpt/detached", leave_running=False)
        finally:
            await sb.close()
        restored = await AsyncSandbox.restore("ckpt/detached", store=store, node_dir=node)
        try:
            after: list[bytes] = []
            again = await restored.reattach(pid, on_stdout=after.append)
            deadline = time.monotonic() + 10
            while len(_numbers(after)) < 10:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            seen = _numbers(before) + _numbers(after)
            assert seen == list(range(len(seen)))
            again.kill()
            assert (await again.wait()).exit_code == 137
        finally:
            await restored.close()

    asyncio.run(main())
