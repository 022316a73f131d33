"""envbuild: upstream's files tests against a ``--fleet`` server (./conftest.py)."""

from tests.integration.e2b_upstream.fleet import upstream

globals().update(upstream(
    "sync.files.test_read", "sync.files.test_write", "sync.files.test_info",
    "sync.files.test_exists", "sync.files.test_make_dir", "sync.files.test_rename",
    "sync.files.test_remove", "sync.files.test_content_encoding", "sync.files.test_files_list"))
