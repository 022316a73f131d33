"""Conformance, the sandbox's life beyond one server process (issue 37 items 1 and 4): a
sandbox survives a restart of ``envbuild serve`` (SIGTERM or SIGKILL) and is re-attached from
the node's records with its token; pause / resume keep a process's memory (CRIU). The real
``e2b`` SDK against the real server and real runc sandboxes."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.e2b_server import e2b_env, running_server

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"
# a shell loop whose counter lives in its memory (written to a temporary name, then renamed:
# ``echo > file`` truncates first; see tests/integration/test_checkpoint.py)
COUNTER = ("cd /workspace && (i=0; while true; do i=$((i+1)); echo $i > /workspace/count.new; "
           "mv /workspace/count.new /workspace/count; sleep 0.1; done) > /dev/null 2>&1 &")


def _health(url: str, sandbox_id: str, token: str) -> int:
    return httpx.get(f"{url}/health", headers={"E2b-Sandbox-Id": sandbox_id,
                                               "X-Access-Token": token}).status_code


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_sandbox_survives_a_server_restart(e2b_built, tmp_path, how):
    """Stop the server with a command streaming; a new server on the same node dir serves the
    sandbox again: same id, files, metadata and token (another sandbox's token does not open
    it); one whose end time passed while no server ran is gone, its runc sandbox too."""
    from e2b import Sandbox, SandboxException, SandboxNotFoundException

    from runtime_shim import list_sandboxes

    _, store, _ = e2b_built
    node = tmp_path / "node"
    with running_server(tmp_path, store.root, node, on_exit="keep") as srv, e2b_env(srv):
        port = srv.url.rsplit(":", 1)[1]
        sb = Sandbox.create(TEMPLATE, timeout=120, metadata={"run": "restart"})
        other = Sandbox.create(TEMPLATE, timeout=120)
        short = Sandbox.create(TEMPLATE, timeout=2)
        sb.files.write("/workspace/mark.txt", "before")
        handle = sb.commands.run("echo up; sleep 60", background=True)
        time.sleep(0.3)
        started = time.monotonic()
        srv.proc.send_signal(how)
        with pytest.raises(SandboxException):
            handle.wait()  # the stream breaks off at once
        srv.proc.wait(30)
        assert time.monotonic() - started < 15
    assert len(list_sandboxes(node)) == 3  # all three still run without a server
    record = node / "serve" / f"{sb.sandbox_id}.json"
    assert record.stat().st_mode & 0o777 == 0o600
    assert (node / "serve").stat().st_mode & 0o777 == 0o700
    time.sleep(2)  # short's end time passes while no server runs
    with running_server(tmp_path, store.root, node, args=("--listen", f"127.0.0.1:{port}")
                        ) as again, e2b_env(again):
        # the old objects, with the tokens of the first server, work on the new one
        assert sb.commands.run("cat /workspace/mark.txt").stdout == "before"
        assert sb.get_info().metadata == {"run": "restart"}
        connected = Sandbox.connect(sb.sandbox_id)
        assert connected.commands.run("echo again").stdout == "again\n"
        assert _health(again.url, sb.sandbox_id, sb._envd_access_token) < 300
        assert _health(again.url, sb.sandbox_id, other._envd_access_token) == 401
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(short.sandbox_id)
        assert {s.sandbox_id for s in Sandbox.list().next_items()} == {sb.sandbox_id,
                                                                       other.sandbox_id}
        assert len(list_sandboxes(node)) == 2
        other.kill()
        assert not (node / "serve" / f"{other.sandbox_id}.json").exists()
    # --on-exit kill (running_server's default): the last sandbox and its record are gone
    assert list(node.glob("serve/*.json")) == []


def test_on_exit_kill_ends_the_sandboxes_and_their_streams(e2b_built, tmp_path):
    """SIGTERM with ``--on-exit kill`` and a command streaming: the server kills its
    sandboxes first, so the stream breaks off at once and the server exits promptly, leaving
    nothing (running_server checks)."""
    from e2b import Sandbox, SandboxException

    _, store, _ = e2b_built
    with running_server(tmp_path, store.root, tmp_path / "node") as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE)
        handle = sb.commands.run("echo up; sleep 60", background=True)
        time.sleep(0.3)
        started = time.monotonic()
        srv.proc.terminate()
        with pytest.raises(SandboxException):
            handle.wait()
        srv.proc.wait(30)
        assert time.monotonic() - started < 15


def test_a_second_server_on_the_same_node_dir_is_refused(e2b_built, tmp_path):
    _, store, _ = e2b_built
    node = tmp_path / "node"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with running_server(tmp_path / "a", store.root, node):
        with pytest.raises(AssertionError, match="another envbuild serve uses"):
            with running_server(tmp_path / "b", store.root, node):
                pass


def _count(sb) -> int:
    return int(sb.commands.run("cat /workspace/count").stdout.strip() or 0)


def test_pause_and_resume_keep_a_process_and_its_memory(e2b_server):
    """A shell loop counts in its memory; paused (CRIU), the sandbox is ``paused`` in get and
    list and its envd is unreachable; ``connect`` resumes it and the loop counts on from where
    it was (not from 1)."""
    from e2b import Sandbox, SandboxQuery, SandboxState

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sb.commands.run(COUNTER)
        sb.files.write("/workspace/note.txt", "kept")
        time.sleep(0.5)
        before = _count(sb)
        assert before > 1
        assert sb.pause() is True
        assert sb.get_info().state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sb.sandbox_id in {s.sandbox_id for s in paused}
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        assert sb.sandbox_id not in {s.sandbox_id for s in running}
        assert not sb.is_running()
        assert Sandbox.pause(sb.sandbox_id) is False  # already paused: E2B's 409
        Sandbox.connect(sb.sandbox_id)  # resumes it
        first = _count(sb)  # the old object's token opens the resumed sandbox
        assert first >= before  # the loop's variable, not a fresh start at 1
        time.sleep(0.5)
        assert _count(sb) > first  # and it counts on
        assert sb.files.read("/workspace/note.txt") == "kept"
        assert sb.get_info().state == SandboxState.RUNNING
    finally:
        sb.kill()


def test_async_pause_filesystem_only_and_resume(e2b_server):
    """``pause(mode="filesystem")``: the files are kept, the processes are not (a cold start
    from the pack-diff); the async SDK."""
    from e2b import AsyncSandbox

    async def scenario():
        sb = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            await sb.files.write("/workspace/f.txt", "files only")
            await sb.commands.run("sleep 600 > /dev/null 2>&1 &")
            assert await sb.pause(mode="filesystem") is True
            assert (await sb.get_info()).state.value == "paused"
            again = await AsyncSandbox.connect(sb.sandbox_id)
            assert await again.files.read("/workspace/f.txt") == "files only"
            ps = (await again.commands.run("ps")).stdout
            assert "sleep 600" not in ps
        finally:
            await sb.kill()

    asyncio.run(scenario())


def test_snapshots_and_sandboxes_created_from_them(e2b_server):
    """``create_snapshot`` (the sandbox runs on): a full one's sandboxes continue its
    processes (the loop counts on), a filesystem one's start fresh from its files."""
    from e2b import Sandbox

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=120)
    made: list = []
    try:
        sb.commands.run(COUNTER)
        sb.files.write("/workspace/note.txt", "snapshotted")
        time.sleep(0.5)
        full = sb.create_snapshot()
        files = sb.create_snapshot("files-only", mode="filesystem")
        assert full.snapshot_id.startswith("e2b/snapshots/") and full.names == [full.snapshot_id]
        assert files.snapshot_id == "e2b/fs-snapshots/files-only"
        assert sb.commands.run("echo on").stdout == "on\n"  # it runs on
        made.append(Sandbox.create(full.snapshot_id, timeout=60))
        made.append(Sandbox.create(files.snapshot_id, timeout=60))
        live, cold = made
        assert live.get_info().template_id == full.snapshot_id
        first = _count(live)
        assert first > 1
        assert live.files.read("/workspace/note.txt") == "snapshotted"
        assert cold.files.read("/workspace/note.txt") == "snapshotted"
        time.sleep(0.5)
        assert _count(live) > first
        frozen = _count(cold)
        time.sleep(0.3)
        assert _count(cold) == frozen  # no loop: a fresh start from the files
    finally:
        for s in (sb, *made):
            s.kill()


def test_fork_gives_independent_children_that_continue(e2b_server):
    """``fork(count=2)``: two sandboxes continuing the parent's loop, each its own files; the
    parent runs on with its id."""
    from e2b import Sandbox

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    sb = Sandbox.create(TEMPLATE, timeout=120, metadata={"role": "parent"})
    children: list = []
    try:
        sb.commands.run(COUNTER)
        time.sleep(0.5)
        children = sb.fork(count=2, timeout=60)
        assert all(isinstance(c, Sandbox) for c in children), children
        a, b = children
        assert len({sb.sandbox_id, a.sandbox_id, b.sandbox_id}) == 3
        assert a.get_info().metadata == {"role": "parent"}
        a.files.write("/workspace/mine.txt", "a")
        assert not b.files.exists("/workspace/mine.txt")
        for s in (sb, a, b):
            first = _count(s)
            assert first > 1
            time.sleep(0.3)
            assert _count(s) > first
    finally:
        for s in (sb, *children):
            if isinstance(s, Sandbox):
                s.kill()


def test_a_paused_sandbox_survives_a_server_restart(e2b_built, tmp_path):
    """Paused, then the server restarts: the new server lists it as paused and ``connect``
    resumes it with its memory (the loop counts on)."""
    from e2b import Sandbox, SandboxState

    from tests.integration.test_checkpoint import require_criu

    require_criu()
    _, store, _ = e2b_built
    node = tmp_path / "node"
    with running_server(tmp_path, store.root, node, on_exit="keep") as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=120)
        sb.commands.run(COUNTER)
        time.sleep(0.5)
        before = _count(sb)
        assert sb.pause() is True
    with running_server(tmp_path, store.root, node) as again, e2b_env(again):
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED
        resumed = Sandbox.connect(sb.sandbox_id)
        first = _count(resumed)
        assert first >= before
        time.sleep(0.5)
        assert _count(resumed) > first
