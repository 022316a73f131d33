"""Conformance, E2B's ``lifecycle`` (issue 37): a sandbox created with ``on_timeout: "pause"``
is paused at its timeout (not killed) and ``connect`` resumes it with its memory; with
``auto_resume`` a request to it (a command) resumes it first, but only with its token; the
policy and the paused state outlive a server restart; bad values are refused in one line. The
real ``e2b`` SDK against the real server and real runc sandboxes (CRIU)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2b_server import e2b_env, running_server
from tests.integration.test_e2b_lifecycle import COUNTER, TEMPLATE, _count

pytestmark = pytest.mark.slow


def _wait_paused(sb, within: float = 60.0) -> None:
    """Poll the control plane (which never wakes a sandbox) until ``sb`` is paused."""
    from e2b import SandboxState

    deadline = time.monotonic() + within
    while sb.get_info().state != SandboxState.PAUSED:
        assert time.monotonic() < deadline, "not paused at its timeout"
        time.sleep(0.2)


def test_a_timeout_pauses_and_connect_resumes(e2b_server):
    """``on_timeout: "pause"``: at the timeout the sandbox is paused (listed as such, its envd
    unreachable: no auto-resume), not killed; ``connect`` resumes it and the shell loop counts
    on from its memory."""
    from e2b import Sandbox, SandboxQuery, SandboxState

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=4, lifecycle={"on_timeout": "pause"})
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sb.commands.run(COUNTER)
        time.sleep(0.5)
        before = _count(sb)
        _wait_paused(sb)
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sb.sandbox_id in {s.sandbox_id for s in paused}
        assert not sb.is_running()  # no auto-resume: a request does not wake it
        assert sb.get_info().state == SandboxState.PAUSED
        resumed = sb.connect()
        assert resumed.sandbox_id == sb.sandbox_id
        first = _count(resumed)
        assert first >= before  # the loop's memory, not a fresh start
        time.sleep(0.5)
        assert _count(resumed) > first  # and it counts on
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()


def test_auto_resume_wakes_on_a_command_with_the_token_only(e2b_server):
    """``auto_resume``: paused at its timeout; a request with another token does not wake it
    (502, still paused); a command with its own resumes it first and runs, memory kept."""
    from e2b import Sandbox, SandboxState

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=4,
                        lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        sb.commands.run(COUNTER)
        time.sleep(0.5)
        before = _count(sb)
        _wait_paused(sb)
        stranger = httpx.get(f"{e2b_server.url}/health", headers={
            "E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": "x" * 43})
        assert stranger.status_code == 502
        assert sb.get_info().state == SandboxState.PAUSED
        assert _count(sb) >= before  # the command resumed it first
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()


@pytest.mark.parametrize("body, word", [
    ({"autoPause": "yes"}, "autoPause"),
    ({"autoPauseMemory": 1, "autoPause": True}, "autoPauseMemory"),
    ({"autoResume": {"enabled": True}}, "autoResume needs autoPause"),
    ({"autoPause": True, "autoResume": {"enabled": "always"}}, "autoResume"),
    ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
     "autoPauseMemory: false"),
])
def test_bad_lifecycle_values_are_refused_in_one_line(e2b_server, body, word):
    r = httpx.post(f"{e2b_server.url}/sandboxes", headers={"X-API-KEY": e2b_server.api_key},
                   json={"templateID": TEMPLATE, **body})
    assert r.status_code == 400
    message = r.json()["message"]
    assert word in message and "\n" not in message


def test_the_lifecycle_and_a_timeout_pause_survive_a_server_restart(e2b_built, tmp_path):
    """The end time passes while no server runs: the next server pauses the sandbox (its
    lifecycle from the record) instead of killing it, and a request with its token
    auto-resumes it."""
    from e2b import Sandbox, SandboxState

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    _, store, _ = e2b_built
    node = tmp_path / "node"
    with running_server(tmp_path, store.root, node, on_exit="keep") as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=3,
                            lifecycle={"on_timeout": "pause", "auto_resume": True})
        sb.files.write("/workspace/mark.txt", "kept")
    time.sleep(3)
    with running_server(tmp_path, store.root, node) as again, e2b_env(again):
        info = Sandbox.get_info(sb.sandbox_id)
        assert info.state == SandboxState.PAUSED
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}
        health = httpx.get(f"{again.url}/health", headers={
            "E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token})
        assert health.status_code < 300
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.RUNNING
        resumed = Sandbox.connect(sb.sandbox_id, timeout=60)
        assert resumed.files.read("/workspace/mark.txt") == "kept"
        resumed.kill()
