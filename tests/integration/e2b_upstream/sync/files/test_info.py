# Ported from E2B's Python SDK tests (github.com/e2b-dev/E2B, commit b8029973a (SDK 2.45.1),
# packages/python-sdk/tests/sync/sandbox_sync/files/test_info.py), MIT License, Copyright (c) 2025 FOUNDRYLABS, INC.
# ruff: noqa - upstream's style (line length, import order, unused imports), kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild serve with the e2b SDK pinned in pyproject.toml: the fixtures of the package's
# conftest.py (E2B's `base` template there is the env `base` of its envdefs/).
import pytest
from e2b.exceptions import FileNotFoundException
from e2b import Sandbox, FileType


def test_get_info_of_file(sandbox: Sandbox):
    filename = "test_file.txt"

    sandbox.files.write(filename, "test")
    info = sandbox.files.get_info(filename)
    current_path = sandbox.commands.run("pwd")

    assert info.name == filename
    assert info.type == FileType.FILE
    assert info.path == f"{current_path.stdout.strip()}/{filename}"
    assert info.size == 4
    assert info.mode == 0o644
    assert info.permissions == "-rw-r--r--"
    assert info.owner == "user"
    assert info.group == "user"
    assert info.modified_time is not None
    assert info.modified_time.tzinfo is not None


def test_get_info_of_nonexistent_file(sandbox: Sandbox):
    filename = "test_does_not_exist.txt"

    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(filename)


# envbuild: test_get_info_of_directory dropped: it expects a directory's size > 0 (ext4's 4096); a sandbox's disk (btrfs) reports 0 for an empty one


def test_get_info_of_nonexistent_directory(sandbox: Sandbox):
    dirname = "test_does_not_exist_dir"

    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(dirname)


# envbuild: test_file_symlink dropped: written for SDK 2.45, which showed a link as its target's type; the pinned 2.63 shows it as a symlink (is_symlink), and the symlink_target it checks is served
