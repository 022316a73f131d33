"""``envbuild.harness.swerex``'s pure parts: the config of keyword arguments, the interpreter
read from ``swerex-remote``'s first line, the launcher, a deployment that is not started. The
deployment against real sandboxes: tests/integration/test_swerex.py. In the integration tier
because it needs the ``harness`` extra (swe-rex), which the fast tier's install lacks."""

from __future__ import annotations

import asyncio

import pytest
from swerex.exceptions import DeploymentNotStartedError

from envbuild.harness.swerex import (
    LAUNCHER,
    EnvbuildDeployment,
    EnvbuildDeploymentConfig,
    remote_python,
)
from runtime_shim import ExecResult, RuntimeShimError


class ProbeSandbox:
    """Answers the one probe ``remote_python`` makes with ``stdout`` / ``code``."""

    id = "eb-fake"

    def __init__(self, stdout: bytes, code: int = 0) -> None:
        self.result = ExecResult(exit_code=code, stdout=stdout, stderr=b"", duration=0.0)
        self.calls: list[list[str]] = []

    def exec(self, cmd, *, timeout=None) -> ExecResult:
        self.calls.append(list(cmd))
        return self.result


def test_config_splits_own_fields_from_sandbox_options():
    c = EnvbuildDeploymentConfig.from_kwargs(
        {"lock": "env/x", "port": 9000, "env": {"A": 1}, "network": False,
         "limits": {"pids": 64}, "ttl": 60})
    assert (c.lock, c.port, dict(c.env)) == ("env/x", 9000, {"A": "1"})
    assert dict(c.options) == {"network": False, "limits": {"pids": 64}, "ttl": 60}
    with pytest.raises(RuntimeShimError, match="no_such_option"):
        EnvbuildDeploymentConfig.from_kwargs({"lock": "env/x", "no_such_option": 1})


@pytest.mark.parametrize(("line", "python"), [
    (b"#!/opt/toolkits/swerex/venv/bin/python3\n", "/opt/toolkits/swerex/venv/bin/python3"),
    (b"#!/usr/bin/env python3.11\n", "python3.11"),
    (b"#! /usr/bin/python3 -E\n", "/usr/bin/python3"),
])
def test_remote_python_is_swerex_remotes_interpreter(line, python):
    sb = ProbeSandbox(line)
    assert remote_python(sb) == python
    assert "command -v swerex-remote" in sb.calls[0][-1]


@pytest.mark.parametrize(("stdout", "code"), [(b"", 1), (b"#!/bin/sh\n", 0), (b"ELF", 0)])
def test_no_swerex_remote_is_one_clear_error(stdout, code):
    with pytest.raises(RuntimeShimError, match="no swerex-remote with a Python") as err:
        remote_python(ProbeSandbox(stdout, code))
    assert "python=" in (err.value.hint or "")


def test_the_launcher_takes_token_and_port_from_its_environment_and_drops_them():
    assert "os.environ.pop('SWEREX_AUTH_TOKEN')" in LAUNCHER
    assert "os.environ.pop('SWEREX_PORT')" in LAUNCHER
    assert "host='127.0.0.1'" in LAUNCHER
    compile(LAUNCHER, "<launcher>", "exec")


def test_a_deployment_needs_a_lock_or_a_sandbox_and_a_start():
    with pytest.raises(RuntimeShimError, match="needs a lock or a sandbox"):
        EnvbuildDeployment()
    d = EnvbuildDeployment(lock="env/x")
    for name in ("runtime", "sandbox", "forward"):
        with pytest.raises(DeploymentNotStartedError):
            getattr(d, name)
    with pytest.raises(DeploymentNotStartedError):
        asyncio.run(d.is_alive())
    asyncio.run(d.stop())  # nothing to stop: a no-op
