"""Conformance, background commands across a memory pause (issue 37): E2B keeps a
``commands.run(..., background=True)`` process across pause and resume, and so does envbuild
(the server detaches it in the agent before CRIU dumps the sandbox and takes it up after:
``envbuild.serve.envd_process``). The real ``e2b`` SDK against the real server, real runc
and real CRIU; commands as root (this host's root lacks CAP_SYS_RESOURCE:
docs/criu-rlimits.md)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.integration.test_checkpoint import require_criu
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"
COUNT = "i=0; while :; do echo $i; i=$((i+1)); sleep 0.1; done"


def _numbers(chunks: list[str]) -> list[int]:
    return [int(x) for x in "".join(chunks).split()]


def _follow(handle, chunks: list[str]) -> tuple[threading.Thread, list[BaseException]]:
    """``handle.wait`` in a thread (the sync SDK streams a background command's output to
    its callbacks only while waiting); what it raised lands in the list."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            handle.wait(on_stdout=chunks.append)
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            raised.append(e)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, raised


def test_a_background_command_counts_on_across_pause_and_connect(e2b_server):
    """Started in the background, paused (CRIU), resumed by ``connect``: ``commands.list``
    shows it with its pid, ``commands.connect(pid)`` streams its counting on from where it
    was (not from 0), stdin-less signals reach it, and its end comes to the connected
    handle."""
    from e2b import CommandExitException, Sandbox

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        before: list[str] = []
        handle = sb.commands.run(COUNT, background=True, user="root")
        first, first_raised = _follow(handle, before)
        wait_for(lambda: len(_numbers(before)) >= 5, 15)
        assert sb.pause() is True
        first.join(15)  # the first stream ended with the pause (as a paused E2B sandbox's)
        assert not first.is_alive() and first_raised
        last = _numbers(before)[-1]
        resumed = Sandbox.connect(sb.sandbox_id)
        assert handle.pid in [p.pid for p in resumed.commands.list()]
        after: list[str] = []
        again = resumed.commands.connect(handle.pid)
        follower, raised = _follow(again, after)
        wait_for(lambda: len(_numbers(after)) >= 10, 15)
        seen = _numbers(after)
        assert seen[0] > last  # the loop's own counter: it counted on, it did not restart
        assert seen == list(range(seen[0], seen[0] + len(seen)))
        assert resumed.commands.kill(handle.pid) is True
        follower.join(15)
        assert len(raised) == 1 and isinstance(raised[0], CommandExitException), raised
        assert handle.pid not in [p.pid for p in resumed.commands.list()]
    finally:
        sb.kill()


def test_a_command_that_ends_after_the_resume_reports_its_exit(e2b_server):
    """Paused while it runs, it ends soon after the resume: a ``connect`` made in time gets
    its last output and exit code."""
    from e2b import Sandbox

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        handle = sb.commands.run("sleep 2; echo finished; exit 3", background=True,
                                 user="root")
        assert sb.pause() is True
        Sandbox.connect(sb.sandbox_id)
        out: list[str] = []
        follower, raised = _follow(sb.commands.connect(handle.pid), out)
        follower.join(30)
        assert len(raised) == 1 and getattr(raised[0], "exit_code", None) == 3, raised
        assert "".join(out) == "finished\n"
    finally:
        sb.kill()


def test_a_snapshot_keeps_the_background_command_of_the_sandbox_running(e2b_server):
    """``create_snapshot`` dumps the sandbox while it runs on: its background command is
    detached for the dump and taken up again (before: it was ended)."""
    from e2b import Sandbox

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        handle = sb.commands.run(COUNT, background=True, user="root")
        time.sleep(0.5)
        sb.create_snapshot()
        sb.create_snapshot()  # taken up after the first, it is detached again for the second
        assert handle.pid in [p.pid for p in sb.commands.list()]
        out: list[str] = []
        follower, _ = _follow(sb.commands.connect(handle.pid, timeout=30), out)
        wait_for(lambda: len(_numbers(out)) >= 3, 15)
        assert sb.commands.kill(handle.pid) is True
        follower.join(15)
    finally:
        sb.kill()
