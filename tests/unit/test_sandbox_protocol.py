"""Every sandbox class keeps the signatures of its protocol (``runtime_shim.sdk.protocol``):
the same parameter names, kinds and defaults, so code written for one runs on the others."""

from __future__ import annotations

import inspect

import pytest

from runtime_shim.fleet.client import AsyncFleetSandbox, FleetSandbox
from runtime_shim.sdk.aio import AsyncSandbox
from runtime_shim.sdk.protocol import AsyncSandboxAPI, SandboxAPI
from runtime_shim.sdk.sandbox import Sandbox

EXACT = ("exec", "read_file", "write_file", "set_network", "info", "close")


def _shape(func) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


@pytest.mark.parametrize(("cls", "protocol"), [
    (Sandbox, SandboxAPI), (FleetSandbox, SandboxAPI),
    (AsyncSandbox, AsyncSandboxAPI), (AsyncFleetSandbox, AsyncSandboxAPI),
])
def test_class_keeps_its_protocol(cls, protocol):
    for name in EXACT:
        assert _shape(getattr(cls, name)) == _shape(getattr(protocol, name)), (cls, name)
        assert inspect.iscoroutinefunction(getattr(cls, name)) == \
            inspect.iscoroutinefunction(getattr(protocol, name)), (cls, name)
    first = list(inspect.signature(cls.pack_diff).parameters)[:2]
    assert first == ["self", "publish"]


def test_the_check_sees_a_drifted_signature():
    class Drifted:
        def exec(self, cmd, *, timeout=None, env=None, cwd=None, user=None, stdin=None,
                 on_stdout=None, on_stderr=None):  # check_timeout missing
            ...

    assert _shape(Drifted.exec) != _shape(SandboxAPI.exec)
