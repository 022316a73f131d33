# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/commands/test_send_stdin.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
from e2b import Sandbox


def test_send_stdin_to_process(sandbox: Sandbox):
    cmd = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cmd.pid, "Hello, World!")

    for stdout, _, _ in cmd:
        assert stdout == "Hello, World!"
        break


def test_send_bytes_stdin_to_process(sandbox: Sandbox):
    cmd = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cmd.pid, b"Hello, World!")

    for stdout, _, _ in cmd:
        assert stdout == "Hello, World!"
        break


def test_send_stdin_via_command_handle(sandbox: Sandbox):
    cmd = sandbox.commands.run("cat", background=True, stdin=True)
    cmd.send_stdin("Hello, World!")

    for stdout, _, _ in cmd:
        assert stdout == "Hello, World!"
        break


def test_close_stdin_via_command_handle(sandbox: Sandbox):
    cmd = sandbox.commands.run("cat", background=True, stdin=True)
    cmd.send_stdin("Hello, World!")
    cmd.close_stdin()

    # `cat` exits once stdin is closed (EOF).
    result = cmd.wait()
    assert result.exit_code == 0
    assert result.stdout == "Hello, World!"


def test_send_special_characters_to_process(sandbox: Sandbox):
    cmd = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cmd.pid, "!@#$%^&*()_+")

    for stdout, _, _ in cmd:
        assert stdout == "!@#$%^&*()_+"
        break


def test_send_multiline_string_to_process(sandbox: Sandbox):
    cmd = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cmd.pid, "Hello,\nWorld!")

    for stdout, _, _ in cmd:
        assert stdout == "Hello,\nWorld!"
        break
