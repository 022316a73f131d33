# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/test_timeout.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
from time import sleep
from datetime import datetime

import pytest


@pytest.mark.skip_debug()
def test_shorten_timeout(sandbox):
    sandbox.set_timeout(5)
    sleep(6)

    is_running = sandbox.is_running(request_timeout=5)
    assert is_running is False


@pytest.mark.skip_debug()
def test_shorten_then_lengthen_timeout(sandbox):
    sandbox.set_timeout(5)
    sleep(1)
    sandbox.set_timeout(10)
    sleep(6)
    sandbox.is_running()


@pytest.mark.skip_debug()
def test_get_timeout(sandbox):
    info = sandbox.get_info()
    assert isinstance(info.end_at, datetime)
