# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/test_fork.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import pytest

from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxNotFoundException


@pytest.mark.skip_debug()
def test_fork(sandbox: Sandbox):
    sandbox.files.write("/home/user/state.txt", "state before fork")

    forks = sandbox.fork()
    assert len(forks) == 1

    fork = forks[0]
    assert isinstance(fork, Sandbox)

    try:
        assert fork.sandbox_id != sandbox.sandbox_id

        # The original sandbox keeps running
        assert sandbox.is_running()
        assert fork.is_running()

        # The fork inherits the filesystem state
        assert fork.files.read("/home/user/state.txt") == "state before fork"

        # The fork is independent of the original
        fork.files.write("/home/user/state.txt", "modified in fork")
        assert sandbox.files.read("/home/user/state.txt") == "state before fork"
    finally:
        fork.kill()


@pytest.mark.skip_debug()
def test_fork_multiple(sandbox: Sandbox):
    forks = sandbox.fork(count=2, timeout=60)
    assert len(forks) == 2

    forked_sandboxes = [fork for fork in forks if isinstance(fork, Sandbox)]

    try:
        assert len(forked_sandboxes) == 2

        ids = {s.sandbox_id for s in forked_sandboxes}
        assert len(ids) == 2
        assert sandbox.sandbox_id not in ids

        for fork in forked_sandboxes:
            assert fork.is_running()
    finally:
        for fork in forked_sandboxes:
            fork.kill()


@pytest.mark.skip_debug()
def test_fork_by_id(sandbox: Sandbox):
    forks = Sandbox.fork(sandbox.sandbox_id)
    assert len(forks) == 1

    fork = forks[0]
    assert isinstance(fork, Sandbox)

    try:
        assert fork.is_running()
    finally:
        fork.kill()


@pytest.mark.skip_debug()
def test_fork_killed_sandbox(sandbox_factory):
    sandbox = sandbox_factory()
    sandbox.kill()

    with pytest.raises(SandboxNotFoundException):
        sandbox.fork()


def test_fork_invalid_count():
    with pytest.raises(InvalidArgumentException):
        Sandbox.fork("sbx-test", count=0)
