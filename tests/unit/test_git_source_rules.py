"""Which git urls and revs reach git (issue 11, item 1): the allow-list, as the pin and the
importer check it and as the schema states it."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from envbuild.build.pin import git_source_problem

GOOD_URLS = ["https://github.com/o/r.git", "http://h/r", "ssh://git@h:22/r.git", "git://h/r",
             "file:///srv/r.git", "git@github.com:o/r.git", "host:path/r.git", "../../repo",
             "/srv/repos/r.git", "repo"]
BAD_URLS = ["--upload-pack=touch $X;exit 1 #@x:y", "-u", "ext::sh -c touch% /tmp/x",
            "fd::17", "ext::ssh", "transport::addr", "https://h/r\n--x", ""]
GOOD_REVS = ["main", "v1.2.3", "release/2024", "0123456789abcdef0123456789abcdef01234567",
             "HEAD~1", "v1^{}"]
BAD_REVS = ["--output=/tmp/x", "-n", "main\n", "a b"]


def _schema_pattern(field: str) -> re.Pattern:
    common = json.loads(resources.files("envbuild.defs").joinpath("schema/common.json")
                        .read_text())
    props = common["$defs"]["workspaceSource"]["properties"]["git"]["properties"]
    return re.compile(props[field]["pattern"])


@pytest.mark.parametrize("url", GOOD_URLS)
def test_ordinary_urls_are_allowed(url):
    assert git_source_problem(url, "main") is None
    assert _schema_pattern("url").search(url)


@pytest.mark.parametrize("url", BAD_URLS)
def test_option_and_transport_urls_are_refused(url):
    assert "git url" in git_source_problem(url, "main")
    if url:
        assert not _schema_pattern("url").fullmatch(url)


@pytest.mark.parametrize("rev", GOOD_REVS)
def test_ordinary_revs_are_allowed(rev):
    assert git_source_problem("https://h/r", rev) is None
    assert _schema_pattern("rev").search(rev)


@pytest.mark.parametrize("rev", BAD_REVS)
def test_option_revs_are_refused(rev):
    assert "git rev" in git_source_problem("https://h/r", rev)
