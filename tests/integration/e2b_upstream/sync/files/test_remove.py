# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/files/test_remove.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
from e2b import Sandbox


def test_remove_file(sandbox: Sandbox):
    filename = "test_remove.txt"
    content = "This file will be removed."

    sandbox.files.write(filename, content)

    sandbox.files.remove(filename)

    exists = sandbox.files.exists(filename)
    assert not exists


def test_remove_non_existing_file(sandbox):
    filename = "non_existing_file.txt"
    sandbox.files.remove(filename)
