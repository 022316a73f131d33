"""SWE-ReX's own tests (ported from its v1.4.0 ``tests/``, see each file's header) against
``envbuild.harness.swerex.EnvbuildDeployment``: the fixtures they use, with upstream's names,
backed by one deployment of the ``py-swerex`` env (``tests/swerex_env.py``) for the session —
swerex-remote in a real runc sandbox, reached through the deployment's loopback forward —
where upstream starts the server app in a thread of the test process.

``remote_server``, ``remote_runtime`` and ``runtime_with_default_session`` keep upstream's
scopes and teardown (the runtime is closed after each test, the default session closed after
each test that made it); ``_Action`` and ``_Command`` are upstream's 5-second defaults. Upstream
runs its ``async def`` tests with pytest-asyncio; here ``pytest_pyfunc_call`` runs each on a
fresh event loop (``RemoteRuntime`` opens a new aiohttp session per request, so one runtime
serves every loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Iterator

import pytest
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
)
from swerex.runtime.remote import RemoteRuntime

from envbuild.harness.swerex import EnvbuildDeployment
from tests.swerex_env import ENV


@dataclasses.dataclass
class RemoteServer:
    """Upstream's ``RemoteServer`` (a port on 127.0.0.1 and the headers that authenticate),
    plus the deployment's token and the deployment itself."""

    port: int
    auth_token: str
    deployment: EnvbuildDeployment
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run an ``async def`` test on a fresh event loop (what pytest-asyncio does upstream)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{n: pyfuncitem.funcargs[n] for n in names}))
    return True


@pytest.fixture(scope="session")
def remote_server(swerex_tree) -> Iterator[RemoteServer]:
    tree = swerex_tree
    deployment = EnvbuildDeployment(lock=f"env/{ENV}", store=str(tree.store_dir),
                                    node_dir=str(tree.node))
    asyncio.run(deployment.start())
    try:
        token = deployment.runtime._config.auth_token
        yield RemoteServer(port=deployment.forward.port, auth_token=token,
                           deployment=deployment, headers={"X-API-Key": token})
    finally:
        asyncio.run(deployment.stop())


@pytest.fixture
def remote_runtime(remote_server: RemoteServer) -> Iterator[RemoteRuntime]:
    """Upstream's fixture: a runtime on the server, closed after the test."""
    r = RemoteRuntime(port=remote_server.port, auth_token=remote_server.auth_token)
    try:
        yield r
    finally:
        asyncio.run(r.close())


@pytest.fixture
def runtime_with_default_session(remote_runtime: RemoteRuntime) -> Iterator[RemoteRuntime]:
    """Upstream's fixture: the runtime with the default session, closed after the test."""
    asyncio.run(remote_runtime.create_session(CreateBashSessionRequest()))
    try:
        yield remote_runtime
    finally:
        asyncio.run(remote_runtime.close_session(CloseBashSessionRequest()))


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5
