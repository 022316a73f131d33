"""SWE-ReX on an envbuild sandbox: ``EnvbuildDeployment``.

SWE-ReX (PyPI ``swe-rex``, tested with the version ``envbuild[harness]`` pins) runs an agent's
shell sessions through a *deployment*: something that starts its server, ``swerex-remote`` (a
FastAPI app over ``swerex.runtime.local.LocalRuntime``: pexpect bash sessions, commands, files),
where the agent's commands should run, and hands back a ``RemoteRuntime``, its HTTP client.
``EnvbuildDeployment`` is one (``swerex.deployment.abstract.AbstractDeployment``)::

    deployment = EnvbuildDeployment(lock="env/py-swerex", store="/srv/envbuild-store")
    await deployment.start()
    runtime = deployment.runtime                  # a swerex RemoteRuntime
    await runtime.create_session(CreateBashSessionRequest())
    await runtime.run_in_session(BashAction(command="cd /workspace && ls"))
    await deployment.stop()

``start`` creates the sandbox (from ``lock``: an env ref, a task ref or a lock digest, whose
image carries Python with ``swe-rex`` installed and ``bash``; docs/harnesses.md has a toolkit
for it), starts swerex's server app in it with ``Sandbox.start`` (listening on ``127.0.0.1:
port`` *inside* the sandbox, with a token from ``secrets`` that is new for every deployment,
passed in the server's environment and dropped from it before any session starts, never on a
command line), and opens a ``LoopbackForward`` (``envbuild.harness.portforward``) on this
host's ``127.0.0.1`` that relays each connection of this process's user (another user's is
closed unread) through ``Sandbox.connect_port`` — made in the sandbox's own network
namespace, so the sandbox keeps ``network=False`` (the default) and nothing of the host is
reachable from it. ``stop`` closes the runtime's sessions, the forward,
the server and the sandbox it created; a ``sandbox=`` passed in stays its owner's.

Nothing the agent's commands print is a reward: grade the sandbox by
``EnvbuildDeployment.sandbox_id`` with ``runtime_shim.grade`` (docs/harnesses.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime
from swerex.utils.log import get_logger

from envbuild.harness.options import sandbox_option_values, split_options
from envbuild.harness.portforward import MAX_CONNECTIONS, LoopbackForward
from runtime_shim import ExecResult, PortRefused, Process, RuntimeShimError, Sandbox

#: The environment variables that carry the token and port to the launcher (it removes them
#: from its environment, so the sessions and commands it runs never see them).
TOKEN_VAR = "SWEREX_AUTH_TOKEN"
PORT_VAR = "SWEREX_PORT"
#: What the server runs: swerex's own server app (``swerex.server.app``, what ``swerex-remote``
#: serves) with its token set as ``swerex-remote --auth-token`` sets it, on the loopback of
#: the sandbox, access log off (its output goes to ``LOG``; an unbounded log would fill it).
LAUNCHER = (
    "import os, uvicorn, swerex.server as s\n"
    f"s.AUTH_TOKEN = os.environ.pop({TOKEN_VAR!r})\n"
    f"port = int(os.environ.pop({PORT_VAR!r}))\n"
    "uvicorn.run(s.app, host='127.0.0.1', port=port, log_level='warning', access_log=False)\n"
)
#: Where the server's own output goes inside the sandbox (shown when it fails to start).
LOG = "/tmp/swerex-remote.log"
#: The console script whose interpreter runs the launcher when ``python`` is not given.
REMOTE_SCRIPT = "swerex-remote"
_POLL = 0.05
#: Seconds ``stop`` waits for the killed server (of a sandbox it keeps open) to be gone.
KILL_WAIT = 10.0


class ServedSandbox(Protocol):
    """What a deployment needs of its sandbox: ``runtime_shim.Sandbox`` is one (a sandbox
    whose processes outlive a call and whose ports can be reached)."""

    @property
    def id(self) -> str: ...

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None
             ) -> ExecResult: ...

    def start(self, cmd: str | Sequence[str], *, timeout: float | None = None,
              env: Mapping[str, str] | None = None) -> Process: ...

    def connect_port(self, port: int, timeout: float = 10.0) -> socket.socket: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class EnvbuildDeploymentConfig:
    """The deployment's settings (any other keyword is a ``SandboxOptions`` field, kept in
    ``options``). ``port``: where the server listens inside the sandbox; ``python``: the
    interpreter that imports ``swerex`` ("": the one on the first line of ``swerex-remote``
    found on the sandbox's PATH); ``env``: the server's environment, which its sessions and
    commands inherit (over the image's); ``startup_timeout``: seconds until the server answers;
    ``runtime_timeout``: the ``RemoteRuntime``'s ``timeout`` (its ``is_alive`` probes);
    ``server_lifetime``: seconds the server may run; ``max_connections``: connections the
    forward relays at once."""

    lock: str = ""
    store: str | None = None
    node_dir: str | None = None
    port: int = 8000
    python: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    startup_timeout: float = 60.0
    runtime_timeout: float = 60.0
    server_lifetime: float = 86400.0
    max_connections: int = MAX_CONNECTIONS
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, fields: Mapping[str, Any]) -> EnvbuildDeploymentConfig:
        """The config of keyword arguments; a name that is neither ours nor a
        ``SandboxOptions`` field is a ``RuntimeShimError`` naming both lists."""
        mine, options = split_options(cls, fields)
        return cls(**mine, options=options)


class EnvbuildDeployment(AbstractDeployment):
    """SWE-ReX's deployment protocol on one envbuild sandbox (module docstring).

    Either it creates the sandbox from ``lock`` (keyword arguments: the fields of
    ``EnvbuildDeploymentConfig`` and ``SandboxOptions`` fields) and closes it in ``stop``, or a
    trainer passes a running ``sandbox=``, which stays the trainer's to close."""

    def __init__(self, *, sandbox: ServedSandbox | None = None,
                 logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self.config = EnvbuildDeploymentConfig.from_kwargs(kwargs)
        if sandbox is None and not self.config.lock:
            raise RuntimeShimError("EnvbuildDeployment needs a lock or a sandbox",
                                   hint="pass lock='env/NAME' (or task/NAME, a digest) of an "
                                        "env with swe-rex installed, or sandbox=")
        self.logger = logger or get_logger("rex-deploy")
        self._hooks = CombinedDeploymentHook()
        self._given = sandbox
        self._sandbox: ServedSandbox | None = None
        self._owned = False
        self._server: Process | None = None
        self._forward: LoopbackForward | None = None
        self._runtime: RemoteRuntime | None = None

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> RemoteRuntime:
        """The ``RemoteRuntime`` of the started deployment (``DeploymentNotStartedError``
        before ``start`` and after ``stop``)."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    @property
    def sandbox(self) -> ServedSandbox:
        """The sandbox the server runs in (``DeploymentNotStartedError`` when none)."""
        if self._sandbox is None:
            raise DeploymentNotStartedError()
        return self._sandbox

    @property
    def sandbox_id(self) -> str:
        """The sandbox's id: what ``runtime_shim.grade(task, sandbox_id)`` grades."""
        return self.sandbox.id

    @property
    def forward(self) -> LoopbackForward:
        """The host's loopback forward to the server (``DeploymentNotStartedError`` when
        none)."""
        if self._forward is None:
            raise DeploymentNotStartedError()
        return self._forward

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """The server's ``is_alive`` (``DeploymentNotStartedError`` before ``start``)."""
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Create the sandbox, start the server in it, open the forward and wait until the
        server answers through it (``startup_timeout``). On failure everything made so far
        is closed again and the error says why (with the server's log when it had one)."""
        if self._runtime is not None:
            return
        self._hooks.on_custom_step("Starting envbuild sandbox")
        started = time.monotonic()
        try:
            await asyncio.to_thread(self._start_server)
            self._hooks.on_custom_step("Starting runtime")
            await self._wait_alive(started + self.config.startup_timeout)
        except BaseException:
            await asyncio.to_thread(self._close)
            raise
        self.logger.info("SWE-ReX runtime in sandbox %s on 127.0.0.1:%d (%.2f s)",
                         self.sandbox_id, self.forward.port, time.monotonic() - started)

    async def _wait_alive(self, deadline: float) -> None:
        """Until the server answers ``is_alive`` through the forward. (Not the runtime's
        ``wait_until_alive``: its probes time out after 0.1 s, which a loaded host misses.)"""
        while True:
            left = deadline - time.monotonic()
            answer = await self.runtime.is_alive(timeout=max(min(left, 10.0), 1.0))
            if answer.is_alive:
                return
            if time.monotonic() > deadline:
                raise RuntimeShimError(f"swerex's server in sandbox {self.sandbox_id} did not "
                                       f"answer in time: {answer.message.strip()[-2000:]}",
                                       hint="a larger startup_timeout=, or a less loaded host")
            await asyncio.sleep(_POLL)

    def _start_server(self) -> None:
        """The blocking part of ``start``: sandbox, server, forward, runtime."""
        if self._given is not None:
            self._sandbox = self._given
        else:
            made = Sandbox.create(self.config.lock, store=self.config.store,
                                  node_dir=self.config.node_dir,
                                  **sandbox_option_values(self.config.options))
            self._sandbox, self._owned = made, True
        sandbox, port = self._sandbox, self.config.port
        python = self.config.python or remote_python(sandbox)
        token = secrets.token_urlsafe(32)
        self._server = sandbox.start(
            ["/bin/sh", "-c", f'exec "$0" -c "$1" >>{LOG} 2>&1', python, LAUNCHER],
            env={**self.config.env, TOKEN_VAR: token, PORT_VAR: str(port)},
            timeout=self.config.server_lifetime)
        deadline = time.monotonic() + self.config.startup_timeout
        wait_listening(sandbox, self._server, port, deadline)
        self._forward = LoopbackForward(lambda: sandbox.connect_port(port),
                                        max_connections=self.config.max_connections,
                                        name="swerex")
        self._runtime = RemoteRuntime(host="http://127.0.0.1", port=self._forward.port,
                                      auth_token=token, timeout=self.config.runtime_timeout,
                                      logger=self.logger)

    async def stop(self) -> None:
        """Close the runtime's sessions, then the forward, the server and the sandbox this
        deployment created. Idempotent; safe before ``start``."""
        runtime = self._runtime
        if runtime is not None:
            try:
                await asyncio.wait_for(runtime.close(), 10)
            except Exception as e:  # noqa: BLE001 - a dead server is what stop ends anyway
                self.logger.debug("closing the runtime of sandbox %s: %s", self._sandbox, e)
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self._runtime = None
        forward, self._forward = self._forward, None
        server, self._server = self._server, None
        sandbox, self._sandbox = self._sandbox, None
        if forward is not None:
            forward.close()
        if server is not None and not server.done:
            try:
                server.kill()
                server.wait(KILL_WAIT)
            except (RuntimeShimError, TimeoutError) as e:
                self.logger.debug("stopping swerex's server: %s", e)
        if sandbox is not None and self._owned:
            self._owned = False
            sandbox.close()

    def __del__(self) -> None:
        # AbstractDeployment's runs ``stop`` on an event loop; without one, close directly
        if getattr(self, "_forward", None) is not None or getattr(self, "_owned", False):
            try:
                self._close()
            except Exception:  # noqa: BLE001, S110 - at interpreter exit; the sandbox's own
                pass           # exit handler closes it (runtime_shim.isolation.lifecycle)


def remote_python(sandbox: ServedSandbox) -> str:
    """The interpreter on the first line of ``swerex-remote`` on the sandbox's PATH: the one
    its ``swerex`` is installed for (a toolkit's venv python)."""
    probe = sandbox.exec(["/bin/sh", "-c", f'head -n1 "$(command -v {REMOTE_SCRIPT})"'],
                         timeout=30)
    line = probe.stdout.decode(errors="replace").strip()
    if probe.exit_code != 0 or not line.startswith("#!") or "python" not in line:
        raise RuntimeShimError(f"no {REMOTE_SCRIPT} with a Python interpreter on the PATH of "
                               f"sandbox {sandbox.id}",
                               hint="install swe-rex in the env (docs/harnesses.md has a "
                                    "toolkit), or pass python= naming the interpreter that "
                                    "imports swerex")
    words = shlex.split(line[2:])
    return words[-1] if words and words[0].endswith("/env") else words[0]


def wait_listening(sandbox: ServedSandbox, server: Process, port: int, deadline: float) -> None:
    """Return once something listens on ``port`` in the sandbox; a server that exits or a
    deadline that passes first is a ``RuntimeShimError`` with the tail of the server's log."""
    while True:
        try:
            sandbox.connect_port(port, timeout=5).close()
            return
        except PortRefused:
            pass
        if server.done or time.monotonic() > deadline:
            break
        time.sleep(_POLL)
    try:
        tail = sandbox.exec(["/bin/sh", "-c", f"tail -c 4000 {LOG}"], timeout=10).stdout
    except RuntimeShimError as e:
        tail = str(e).encode()
    what = "exited" if server.done else "did not listen in time"
    raise RuntimeShimError(f"swerex's server in sandbox {sandbox.id} {what} (port {port}):\n"
                           f"{tail.decode(errors='replace').strip()}",
                           hint="does the env have swe-rex and bash? (docs/harnesses.md)")


__all__ = ["EnvbuildDeployment", "EnvbuildDeploymentConfig", "LAUNCHER", "remote_python"]
