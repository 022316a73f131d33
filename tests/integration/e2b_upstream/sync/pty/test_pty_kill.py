# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/pty/test_pty_kill.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import pytest

from e2b import Sandbox, CommandExitException
from e2b.sandbox.commands.command_handle import PtySize


def test_kill_pty(sandbox: Sandbox):
    terminal = sandbox.pty.create(PtySize(80, 24))

    assert sandbox.pty.kill(terminal.pid)

    # The PTY process should no longer be running.
    with pytest.raises(CommandExitException):
        sandbox.commands.run(f"kill -0 {terminal.pid}")


def test_kill_non_existing_pty(sandbox: Sandbox):
    non_existing_pid = 999999

    assert not sandbox.pty.kill(non_existing_pid)
