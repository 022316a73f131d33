"""The SDK as a user meets it, over real runc: defaults, errors, lifecycle, streaming, asyncio."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runtime_shim import (
    AsyncSandbox,
    Limits,
    LockNotFound,
    Sandbox,
    SandboxClosed,
    list_sandboxes,
)
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.isolation.runc import OciRuntime, list_containers
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.integration
ENV = "env/busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdk"))


def _assert_clean(node: Path) -> None:
    assert mounted_targets_under(str(node / "sandboxes")) == []
    assert list_containers(OciRuntime(state_root=str(node / "runc"))) == []
    assert not any((node / "sandboxes").iterdir())


def test_store_as_a_path_and_the_node_cache_from_the_environment(built, monkeypatch):
    store, node = built
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(node))
    with Sandbox.create(ENV, store=str(store.root)) as sb:
        assert sb.exec("echo hi").stdout == b"hi\n"
        info = sb.info()
        assert (info.backend, info.lock, info.node) == ("container", sb.lock.digest, str(node))
        assert info.ready >= info.created > 0
    _assert_clean(node)


def test_a_wrong_ref_raises_lock_not_found_and_leaves_nothing(built, tmp_path, monkeypatch):
    store, _ = built
    node = tmp_path / "fresh-node"
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(node))
    with pytest.raises(LockNotFound):
        Sandbox.create("env/no-such-env", store=str(store.root))
    assert not node.exists()


def test_streaming_output_arrives_while_the_command_runs(built):
    store, node = built
    seen: list[tuple[float, bytes]] = []
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        t0 = time.monotonic()
        r = sb.exec("echo one; sleep 0.5; echo two >&2; sleep 0.5; echo three",
                    on_stdout=lambda b: seen.append((time.monotonic() - t0, b)),
                    on_stderr=lambda b: seen.append((time.monotonic() - t0, b"E" + b)))
    assert [b for _, b in seen] == [b"one\n", b"Etwo\n", b"three\n"]
    assert seen[0][0] < 0.4 < seen[1][0] < 0.9 < seen[2][0]  # each as it was written
    assert r.stdout == b"one\nthree\n" and r.duration >= 1.0


def test_twenty_async_sandboxes_stream_and_leave_nothing(built):
    store, node = built
    n = 20

    # small ones: twenty default sandboxes (10 GiB disks, 256 x 1024 files) are past the
    # node's budget (runtime_shim.node.admission; issue 34)
    small = Limits(pids=32, nofile=256, disk_bytes=64 << 20, inodes=4096)

    async def one(i: int, lines: list[bytes]) -> int:
        async with await AsyncSandbox.create(ENV, store=store, node_dir=node,
                                             limits=small) as sb:
            r = await sb.exec(f"for k in 1 2 3; do echo {i}.$k; sleep 0.2; done",
                              on_stdout=lines.append)
            await sb.write_file("/tmp/x", b"y")
            assert await sb.read_file("/tmp/x") == b"y"
            return r.exit_code

    async def main():
        outputs = [[] for _ in range(n)]
        codes = await asyncio.gather(*(one(i, outputs[i]) for i in range(n)))
        return codes, outputs

    codes, outputs = asyncio.run(main())
    assert codes == [0] * n
    for i, lines in enumerate(outputs):
        assert b"".join(lines) == f"{i}.1\n{i}.2\n{i}.3\n".encode()
    _assert_clean(node)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(node / "sandboxes") not in ps


def test_ttl_reaper_thread_removes_a_forgotten_sandbox(built):
    store, node = built
    sb = Sandbox.create(ENV, store=store, node_dir=node, ttl=1)
    deadline = time.monotonic() + 10
    while sb.paths.root.exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the reaper thread of this process closes it after 1 s
    assert sb.closed
    with pytest.raises(SandboxClosed):
        sb.exec("true")
    _assert_clean(node)


def test_a_create_with_nothing_to_sweep_reads_no_sandbox_record(built, monkeypatch):
    """The sweep at create costs O(creators), not O(sandboxes) (issue 39): with every creator
    alive and no TTL passed, create lists no sandbox; once a TTL passes, it sweeps again."""
    import runtime_shim.sdk.sweep as sweep

    store, node = built
    live = [Sandbox.create(ENV, store=store, node_dir=node) for _ in range(3)]
    try:
        listed = []
        real = sweep.list_sandboxes
        monkeypatch.setattr(sweep, "list_sandboxes", lambda *a: listed.append(a) or real(*a))
        Sandbox.create(ENV, store=store, node_dir=node).close()
        assert listed == []
        short = Sandbox.create(ENV, store=store, node_dir=node, keep=True, ttl=1)
        time.sleep(1.2)
        Sandbox.create(ENV, store=store, node_dir=node).close()
        assert len(listed) == 1
        assert short.id not in {s.id for s in list_sandboxes(node)}   # the expired one went
    finally:
        for sb in live:
            sb.close()


def test_orphans_and_expired_kept_sandboxes_are_reaped(built, tmp_path):
    """A process that created a sandbox dies by SIGKILL: the next create on the node removes
    what it left; ``envbuild sandbox gc`` removes a kept sandbox past its TTL."""
    store, node = built
    script = textwrap.dedent(f"""
        import os, sys
        from runtime_shim import Sandbox
        sb = Sandbox.create({ENV!r}, store={str(store.root)!r}, node_dir={str(node)!r})
        kept = Sandbox.create({ENV!r}, store={str(store.root)!r}, node_dir={str(node)!r},
                              keep=True, ttl=2)
        from runtime_shim.sdk import exitwatch
        exitwatch.stop()  # a crash its watcher dies in too: the next create reaps
        print(sb.id, kept.id, flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    orphan, kept = proc.stdout.readline().split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert {s.id for s in list_sandboxes(node)} == {orphan, kept}
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        assert {s.id for s in list_sandboxes(node)} == {kept, sb.id}  # orphan reaped
    time.sleep(2.2)
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node)}
    gc = subprocess.run([sys.executable, "-m", "envbuild.cli", "sandbox", "gc"], env=env,
                        capture_output=True, text=True)
    assert gc.returncode == 0, gc.stderr
    assert f"removed {kept} (expired)" in gc.stdout
    _assert_clean(node)


def test_sandbox_rm_of_an_unknown_id_says_so_and_exits_1(built):
    _, node = built
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node)}
    rm = subprocess.run([sys.executable, "-m", "envbuild.cli", "sandbox", "rm",
                         "eb-000000000000"], env=env, capture_output=True, text=True)
    assert rm.returncode == 1
    assert "removed" not in rm.stdout


def test_attach_from_another_process(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, keep=True) as sb:
        sb.exec("echo there > /tmp/mark")
        script = (f"from runtime_shim import Sandbox\n"
                  f"sb = Sandbox.attach({sb.id!r}, node_dir={str(node)!r})\n"
                  f"print(sb.exec('cat /tmp/mark').stdout.decode(), end='')")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert out.stdout == "there\n", out.stderr
    _assert_clean(node)
