# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/test_snapshot.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import pytest
from e2b import Sandbox


@pytest.mark.skip_debug()
def test_snapshot(sandbox: Sandbox):
    assert sandbox.is_running()

    sandbox.pause()
    assert not sandbox.is_running()

    resumed_sandbox = sandbox.connect()
    assert sandbox.is_running()
    assert resumed_sandbox.is_running()
    assert resumed_sandbox.sandbox_id == sandbox.sandbox_id
