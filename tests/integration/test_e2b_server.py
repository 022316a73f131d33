"""Conformance: the unmodified ``e2b`` SDK (the version ``pyproject.toml`` pins) drives
``envbuild serve`` with only ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` set —
real server process on 127.0.0.1, real runc sandboxes of the busybox env (issue 37 item 5:
lifecycle, commands, files; sync and async)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2b_server import TEMPLATE, assert_run_times_out

pytestmark = pytest.mark.slow


def test_the_sdk_version_is_the_pinned_one():
    from importlib.metadata import version

    assert version("e2b") == "2.63.0"


def test_lifecycle_create_info_list_timeout_connect_kill(e2b_server):
    from e2b import Sandbox, SandboxNotFoundException, SandboxQuery

    sb = Sandbox.create(TEMPLATE, timeout=60, metadata={"suite": "e2b", "n": "1"})
    other = Sandbox.create(TEMPLATE, timeout=60, metadata={"suite": "other"})
    try:
        info = sb.get_info()
        assert info.sandbox_id == sb.sandbox_id and info.template_id == TEMPLATE
        assert info.metadata == {"suite": "e2b", "n": "1"} and info.state.value == "running"
        assert 55 <= (info.end_at - info.started_at).total_seconds() <= 61
        found = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"})).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
        everything = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert {sb.sandbox_id, other.sandbox_id} <= everything
        pages = Sandbox.list(limit=1, query=SandboxQuery(template=TEMPLATE))
        first, second = pages.next_items(), pages.next_items()  # newest first, one a page
        assert [x.sandbox_id for x in first + second] == [other.sandbox_id, sb.sandbox_id]
        assert not pages.has_next
        oldest = Sandbox.list(order="asc", query=SandboxQuery(
            started_after=info.started_at)).next_items()
        assert [x.sandbox_id for x in oldest] == [sb.sandbox_id, other.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(template="other")).next_items() == []
        sb.set_timeout(600)
        assert (sb.get_info().end_at - info.end_at).total_seconds() > 500
        again = Sandbox.connect(sb.sandbox_id)
        assert again.commands.run("echo connected").stdout == "connected\n"
        assert sb.is_running()
    finally:
        sb.kill()
        other.kill()
    assert not sb.is_running()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sb.sandbox_id)
    assert Sandbox.kill(sb.sandbox_id) is False


def test_a_sandbox_past_its_timeout_is_gone(e2b_server):
    from e2b import Sandbox, SandboxNotFoundException

    sb = Sandbox.create(TEMPLATE, timeout=1)
    deadline = time.monotonic() + 30
    while sb.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sb.is_running()
    with pytest.raises(SandboxNotFoundException):
        sb.get_info()


def test_commands_stream_output_env_cwd_and_user(e2b_server):
    from e2b import Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=120, envs={"FROM_CREATE": "c", "BOTH": "create"})
    try:
        out, err = [], []
        r = sb.commands.run("echo one; echo two >&2; sleep 0.1; echo three",
                            on_stdout=out.append, on_stderr=err.append)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "one\nthree\n", "two\n")
        assert "".join(out) == "one\nthree\n" and "".join(err) == "two\n"
        r = sb.commands.run('echo "$FROM_CREATE $BOTH $FROM_RUN"',
                            envs={"FROM_RUN": "r", "BOTH": "run"})
        assert r.stdout == "c run r\n"
        assert sb.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sb.commands.run("pwd").stdout == "/root\n"  # E2B: the user's home
        assert sb.commands.run("id -u", user="root").stdout == "0\n"
        assert sb.commands.run("id -u; echo $HOME", user="agent").stdout == "1000\n/home/agent\n"
    finally:
        sb.kill()


def test_nonzero_exit_and_timeout_are_the_sdk_exceptions(e2b_sandbox):
    from e2b import CommandExitException

    with pytest.raises(CommandExitException) as e:
        e2b_sandbox.commands.run("echo bad >&2; exit 3")
    assert e.value.exit_code == 3 and e.value.stderr == "bad\n"
    assert_run_times_out(e2b_sandbox)  # the server ends the command with its deadline


def test_background_commands_wait_list_and_kill(e2b_sandbox):
    handle = e2b_sandbox.commands.run("sleep 0.3; echo done", background=True)
    assert handle.wait().stdout == "done\n"
    sleeper = e2b_sandbox.commands.run("sleep 60", background=True)
    listed = e2b_sandbox.commands.list()
    assert [p.pid for p in listed] == [sleeper.pid]
    assert listed[0].cmd and "sleep 60" in " ".join(listed[0].args)
    assert e2b_sandbox.commands.kill(sleeper.pid) is True
    deadline = time.monotonic() + 10
    while e2b_sandbox.commands.list() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert e2b_sandbox.commands.list() == []
    assert e2b_sandbox.commands.run("ps -o comm | grep -c '^sleep$' || true").stdout == "0\n"


def test_files(e2b_sandbox):
    from e2b import FileType, NotFoundException

    files = e2b_sandbox.files
    info = files.write("/tmp/t/hello.txt", "héllo\n")
    assert (info.path, info.name, info.type) == ("/tmp/t/hello.txt", "hello.txt", FileType.FILE)
    assert files.read("/tmp/t/hello.txt") == "héllo\n"
    blob = bytes(range(256)) * 100
    files.write("/tmp/t/blob.bin", blob)
    assert bytes(files.read("/tmp/t/blob.bin", format="bytes")) == blob
    assert e2b_sandbox.commands.run("cat /tmp/t/hello.txt").stdout == "héllo\n"
    entries = {e.name: e for e in files.list("/tmp/t")}
    assert set(entries) == {"hello.txt", "blob.bin"}
    assert entries["blob.bin"].size == len(blob) and entries["blob.bin"].type == FileType.FILE
    assert files.exists("/tmp/t/hello.txt") and not files.exists("/tmp/t/nope")
    stat = files.get_info("/tmp/t")
    assert stat.type == FileType.DIR and stat.permissions.startswith("d")
    assert files.make_dir("/tmp/t/sub/deep") is True
    assert files.make_dir("/tmp/t/sub/deep") is False
    deep = {e.path for e in files.list("/tmp/t", depth=3)}
    assert {"/tmp/t/sub", "/tmp/t/sub/deep", "/tmp/t/blob.bin"} <= deep
    moved = files.rename("/tmp/t/hello.txt", "/tmp/t/sub/moved.txt")
    assert moved.path == "/tmp/t/sub/moved.txt"
    assert not files.exists("/tmp/t/hello.txt")
    files.remove("/tmp/t/sub")
    assert not files.exists("/tmp/t/sub/moved.txt")
    with pytest.raises(NotFoundException):
        files.read("/tmp/t/sub/moved.txt")
    with pytest.raises(NotFoundException):
        files.list("/tmp/nope")
    files.remove("/tmp/nope")  # E2B: removing what is not there is no error
    many = files.write_files([{"path": f"/tmp/many/{i}.txt", "data": f"file {i}"}
                              for i in range(20)])
    assert sorted(w.path for w in many) == sorted(f"/tmp/many/{i}.txt" for i in range(20))
    assert files.read("/tmp/many/13.txt") == "file 13" and len(files.list("/tmp/many")) == 20
    files.write("/tmp/odd/a|b c.txt", "odd")  # a name with "|" and a space
    assert [(e.name, e.path) for e in files.list("/tmp/odd")] == [("a|b c.txt",
                                                                   "/tmp/odd/a|b c.txt")]
    files.write("/tmp/mine.txt", "agent's", user="agent")  # written as (owned by) the user
    assert files.get_info("/tmp/mine.txt").owner == "agent"
    assert e2b_sandbox.commands.run("echo more >> /tmp/mine.txt && cat /tmp/mine.txt",
                                user="agent").stdout == "agent's" + "more\n"
    files.write("rel.txt", "relative")  # E2B: relative to the user's home
    assert e2b_sandbox.commands.run("cat /root/rel.txt").stdout == "relative"


def test_async_sdk(e2b_server):
    from e2b import AsyncSandbox, CommandExitException

    async def scenario():
        a, b = await asyncio.gather(AsyncSandbox.create(TEMPLATE, metadata={"async": "yes"}),
                                    AsyncSandbox.create(TEMPLATE))
        try:
            chunks: list[str] = []
            r = await a.commands.run("echo $X", envs={"X": "async"}, on_stdout=chunks.append)
            assert r.stdout == "async\n" and "".join(chunks) == "async\n"
            with pytest.raises(CommandExitException):
                await b.commands.run("exit 7")
            await a.files.write("/tmp/a.txt", "A")
            assert await a.files.read("/tmp/a.txt") == "A"
            assert not await b.files.exists("/tmp/a.txt")  # each sandbox its own files
            await a.set_timeout(300)
            info = await a.get_info()
            assert info.metadata == {"async": "yes"}
            listed = await AsyncSandbox.list().next_items()
            assert {a.sandbox_id, b.sandbox_id} <= {s.sandbox_id for s in listed}
            again = await AsyncSandbox.connect(a.sandbox_id)
            assert (await again.commands.run("cat /tmp/a.txt")).stdout == "A"
        finally:
            await a.kill()
            await b.kill()
        assert not await a.is_running()

    asyncio.run(scenario())


def test_stdin_of_a_background_command_and_signals(e2b_sandbox):
    handle = e2b_sandbox.commands.run("while read l; do echo got:$l; done; echo eof",
                                  background=True, stdin=True)
    e2b_sandbox.commands.send_stdin(handle.pid, "one\n")
    e2b_sandbox.commands.send_stdin(handle.pid, "two\n")
    e2b_sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "got:one\ngot:two\neof\n"
    trapped = e2b_sandbox.commands.run("trap 'echo term; exit 0' TERM; echo up; "
                                   "while :; do sleep 0.05; done", background=True)
    time.sleep(0.5)
    assert trapped.kill() is True  # SIGKILL: the trap cannot run
    from e2b import CommandExitException

    with pytest.raises(CommandExitException) as e:
        trapped.wait()
    assert e.value.exit_code == 137 and e.value.stdout == "up\n"
    # without stdin=True the command's stdin is closed at once (E2B's default)
    assert e2b_sandbox.commands.run("cat; echo done").stdout == "done\n"


def test_connect_to_a_running_command(e2b_sandbox):
    handle = e2b_sandbox.commands.run("sleep 0.5; echo late", background=True)
    again = e2b_sandbox.commands.connect(handle.pid)
    assert again.wait().stdout == "late\n"


def test_a_command_running_when_its_sandbox_is_killed(e2b_server):
    from e2b import Sandbox, SandboxNotRunningException

    sb = Sandbox.create(TEMPLATE, timeout=60)
    handle = sb.commands.run("sleep 60", background=True)
    sb.kill()
    with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
        handle.wait()


def test_a_command_past_its_deadline_ends_its_stream_with_deadline_exceeded(e2b_sandbox):
    """The server's end of a command that ran past the request's ``Connect-Timeout-Ms``:
    the stream's error ``deadline_exceeded`` (the SDK's ``TimeoutException``), as E2B's envd
    ends it, not an end event with exit 124 (which, arriving before the SDK's own timer
    fired, made the async SDK raise ``CommandExitException``). Spoken raw, without that
    timer."""
    import json
    import os
    import struct

    import httpx

    body = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 30"]}}).encode()
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
               "Connect-Timeout-Ms": "1000", "E2b-Sandbox-Id": e2b_sandbox.sandbox_id,
               "E2b-Sandbox-Port": "49983",
               "X-Access-Token": e2b_sandbox._envd_access_token or ""}
    r = httpx.post(os.environ["E2B_SANDBOX_URL"] + "/process.Process/Start", headers=headers,
                   content=struct.pack(">BI", 0, len(body)) + body, timeout=20)
    frames, data = [], r.content
    while data:
        flags, size = struct.unpack(">BI", data[:5])
        frames.append((flags, json.loads(data[5:5 + size])))
        data = data[5 + size:]
    flags, last = frames[-1]
    assert flags & 2 and last.get("error", {}).get("code") == "deadline_exceeded", frames
    assert not any("end" in f.get("event", {}) for _, f in frames[:-1])
