"""A backend whose handles serve stateless calls (``StatelessCalls``) is recognised by what its
handle can do, not by the name it was registered under: its exec is one such call from the
async SDK too, and ``start`` (a process kept between execs) is refused."""

from __future__ import annotations

import asyncio

import pytest

from envbuild.errors import BackendUnavailable
from envbuild.store import LocalStore
from runtime_shim.backends import base as registry
from runtime_shim.backends.base import StatelessCalls
from runtime_shim.backends.fake import FakeBackend, FakeSandbox, fake_lock
from runtime_shim.sdk.aio import AsyncSandbox
from runtime_shim.sdk.sandbox import Sandbox

pytestmark = pytest.mark.fast


class _StatelessSandbox(FakeSandbox):
    def call(self, req, files=None):
        return self.exec(req)

    def reset(self) -> None:
        self.backend.calls["reset"] += 1


class _StatelessBackend(FakeBackend):
    def create(self, req):
        sb = super().create(req)
        sb.__class__ = _StatelessSandbox
        return sb


@pytest.fixture
def stateless(tmp_path):
    backend = _StatelessBackend()
    registry.register("pool-of-calls", backend)  # any name: not "fncall"
    store = LocalStore(tmp_path / "store")
    fake_lock(store)
    sb = Sandbox.create("env/fake", store=store, node_dir=tmp_path / "node",
                        backend="pool-of-calls")
    yield backend, sb
    sb.close()
    registry.unregister("pool-of-calls")


def test_the_handle_is_a_stateless_one(stateless):
    _, sb = stateless
    assert isinstance(sb._backend, StatelessCalls)


def test_start_is_refused_by_capability(stateless):
    _, sb = stateless
    with pytest.raises(BackendUnavailable, match="fresh layer"):
        sb.start("true")


def test_the_async_exec_goes_through_the_handles_exec(stateless):
    backend, sb = stateless
    before = backend.calls["exec"]
    result = asyncio.run(AsyncSandbox(sb).exec("echo hi"))
    assert result.exit_code == 0
    assert backend.calls["exec"] == before + 1  # the handle's exec, not a raw agent exchange
