# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/pty/test_pty_connect.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import pytest

from e2b.sandbox.commands.command_handle import PtySize


@pytest.mark.skip_debug()
def test_connect_to_pty(sandbox_factory):
    sandbox = sandbox_factory(timeout=100)
    output = []

    def append_data(data: list, x: bytes):
        data.append(x.decode("utf-8"))

    terminal = sandbox.pty.create(PtySize(80, 24), envs={"FOO": "bar"})

    sandbox.pty.send_stdin(terminal.pid, b"echo $FOO\n")

    terminal.disconnect()

    # Now connect again, with a new on_pty handler
    reconnect_handle = sandbox.pty.connect(terminal.pid)

    sandbox.pty.send_stdin(terminal.pid, b"echo $FOO\nexit\n")

    result = reconnect_handle.wait(on_pty=lambda x: append_data(output, x))

    assert terminal.pid == reconnect_handle.pid
    assert result.exit_code == 0

    assert "bar" in "".join(output)
