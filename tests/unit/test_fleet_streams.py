"""The data plane's stream messages (``runtime_shim.fleet.streams``): a command's end carries
its result with the outputs raw (no base64 of up to twice the output cap), or the node's
error as its class."""

from __future__ import annotations

import pytest

from envbuild.errors import SandboxNotFound
from runtime_shim.fleet import dataplane
from runtime_shim.fleet.streams import exit_message, read_exit
from runtime_shim.node.model import ExecResult


def test_an_exit_message_carries_the_result_with_its_outputs_raw():
    result = ExecResult(exit_code=3, stdout=bytes(range(256)) * 3, stderr=b"\x00err",
                        duration=1.5, timed_out=True, output_truncated=True)
    message = exit_message(result)
    assert read_exit(message) == result
    assert len(message) < len(result.stdout) + len(result.stderr) + 200, "not base64"
    assert read_exit(exit_message(ExecResult(0, b"", b"", 0.0))).stdout == b""


def test_an_exit_message_carries_the_nodes_error():
    error = dataplane.error_reply(SandboxNotFound("gone", hint="attach again"))
    with pytest.raises(SandboxNotFound, match="gone"):
        read_exit(exit_message(None, error))
