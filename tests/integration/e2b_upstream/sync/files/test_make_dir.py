# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/files/test_make_dir.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import uuid

from e2b import Sandbox


def test_make_directory(sandbox: Sandbox):
    dir_name = f"test_directory_{uuid.uuid4()}"

    sandbox.files.make_dir(dir_name)
    exists = sandbox.files.exists(dir_name)
    assert exists


async def test_make_directory_already_exists(sandbox: Sandbox):
    dir_name = f"test_directory_{uuid.uuid4()}"

    created = sandbox.files.make_dir(dir_name)
    assert created

    created = sandbox.files.make_dir(dir_name)
    assert not created


def test_make_nested_directory(sandbox: Sandbox):
    nested_dir_name = f"test_directory_{uuid.uuid4()}/nested_directory"

    sandbox.files.make_dir(nested_dir_name)
    exists = sandbox.files.exists(nested_dir_name)
    assert exists
