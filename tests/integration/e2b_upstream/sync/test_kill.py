# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/test_kill.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import pytest

from e2b import Sandbox, SandboxQuery, SandboxState


@pytest.mark.skip_debug()
def test_kill(sandbox: Sandbox, sandbox_test_id: str):
    sandbox.kill()

    paginator = Sandbox.list(
        query=SandboxQuery(
            state=[SandboxState.RUNNING], metadata={"sandbox_test_id": sandbox_test_id}
        )
    )
    sandboxes = paginator.next_items()
    assert sandbox.sandbox_id not in [s.sandbox_id for s in sandboxes]
