"""The FnCall backend as a user meets it, over real runc: ``Sandbox.create(backend="fncall")``,
``FnPool`` from many threads, the requests it refuses, and nothing left behind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from envbuild.errors import BackendUnavailable
from runtime_shim.isolation import cgroupfs
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.isolation.runc import OciRuntime, list_containers
from runtime_shim.sdk.fnpool import FnPool
from runtime_shim.sdk.sandbox import Sandbox
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.integration
ENV = "env/busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("fncall"))


def _assert_clean(node: Path) -> None:
    assert mounted_targets_under(str(node / "sandboxes")) == []
    assert list_containers(OciRuntime(state_root=str(node / "runc"))) == []
    assert not any((node / "sandboxes").iterdir())


def test_sandbox_create_fncall_serves_calls_with_stdin(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, backend="fncall") as fn:
        assert fn.info().backend == "fncall"
        for i in range(5):
            got = fn.call("read x; echo got-$x; echo $x > /tmp/seen; ls /tmp", stdin=f"{i}\n")
            assert got.stdout == f"got-{i}\nseen\n".encode(), got
        # exec on an fncall sandbox is a stateless call too
        assert fn.exec("ls -A /tmp").stdout == b""
        # read_file reads what the last call left (the reset comes with the next call)
        fn.call("echo out > /tmp/result")
        assert fn.read_file("/tmp/result") == b"out\n"
    _assert_clean(node)


def test_pool_serves_concurrent_calls_each_in_a_fresh_layer(built):
    store, node = built
    results: list = []
    errors: list = []
    with FnPool(ENV, size=2, store=store, node_dir=node) as pool:
        ids = {sb.id for sb in pool.sandboxes}
        assert len(ids) == 2

        def worker(n: int) -> None:
            try:
                for i in range(6):
                    tag = f"{n}-{i}"
                    r = pool.call(f"ls -A /tmp; echo {tag} > /tmp/mark; read x; echo $x",
                                  stdin=tag)
                    results.append((tag, r))
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(results) == 24
        for tag, r in results:
            assert r.stdout == f"{tag}\n".encode(), (tag, r)  # never another call's mark
        for sb in pool.sandboxes:
            assert cgroupfs.procs(sb.id) == [sb.host_pid]
    _assert_clean(node)


def test_pool_replaces_a_sandbox_whose_reset_fails(built):
    from envbuild.errors import RuntimeShimError

    store, node = built
    with FnPool(ENV, size=1, store=store, node_dir=node) as pool:
        first = pool.sandboxes[0]
        assert pool.call("echo one").stdout == b"one\n"

        def broken() -> None:
            raise RuntimeShimError("simulated: the reset failed")

        first.handle.reset = broken  # the reset before the next call fails
        assert pool.call("echo two").stdout == b"two\n"  # on the replacement
        (second,) = pool.sandboxes
        assert second.id != first.id and first.closed and not first.paths.root.exists()
        assert pool.last_error == "simulated: the reset failed"
    _assert_clean(node)


def test_async_sandbox_on_fncall_resets_between_execs(built):
    import asyncio

    from runtime_shim import AsyncSandbox

    store, node = built

    async def main():
        async with await AsyncSandbox.create(ENV, store=store, node_dir=node,
                                             backend="fncall") as fn:
            first = await fn.exec("echo 1 > /tmp/a; ls /tmp")
            second = await fn.exec("ls -A /tmp")
            third = await fn.call(["cat", "/tmp/x"], files={"/tmp/x": "in"})
            return first, second, third

    first, second, third = asyncio.run(main())
    assert first.stdout == b"a\n" and second.stdout == b"" and third.stdout == b"in"
    _assert_clean(node)


def test_fncall_refuses_network_and_keep_and_leaves_nothing(built):
    store, node = built
    with pytest.raises(BackendUnavailable, match="no network"):
        Sandbox.create(ENV, store=store, node_dir=node, backend="fncall", network=True)
    with pytest.raises(BackendUnavailable, match="kept"):
        Sandbox.create(ENV, store=store, node_dir=node, backend="fncall", keep=True)
    with Sandbox.create(ENV, store=store, node_dir=node) as plain:
        with pytest.raises(BackendUnavailable, match="fncall"):
            plain.call("true")
    _assert_clean(node)


def test_calls_are_reaped_at_once_and_never_use_up_the_pids_limit(built):
    """Each call has a PID 1 of its own (``runtime_shim.isolation.fncall_ns``); the helper that starts it
    stays its parent and reaps it, so no zombie of an earlier call counts against ``pids``."""
    from runtime_shim.node.model import Limits

    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, backend="fncall",
                        limits=Limits(pids=8)) as fn:
        for i in range(40):
            got = fn.call(f"echo $$ {i}")
            assert got.stdout == f"2 {i}\n".encode(), got  # the call's agent is its PID 1
        assert cgroupfs.procs(fn.id) == [fn.host_pid]
    _assert_clean(node)
