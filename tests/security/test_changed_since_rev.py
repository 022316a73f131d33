"""Hostile revisions for ``plan --changed-since REV`` read from git objects: a definition file
that is a symlink at REV is not followed, an option-looking rev is not an option, a huge blob
is one bounded problem, a source path out of the repository is refused as in the working tree."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from envbuild.build.gitrev import keys_at_revision
from envbuild.defs.load import MAX_YAML_BYTES
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import SourceError
from tests.conftest import require_tool

WS = """
    apiVersion: envbuild/v1
    kind: Workspace
    name: {name}
    build_on: deb
    source: {{path: {path}}}
    """
BASE = """
    apiVersion: envbuild/v1
    kind: Base
    name: deb
    abi: deb12
    from: {debootstrap: {suite: bookworm}}
    """


def git(cwd, *argv):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    require_tool("git")
    root = tmp_path / "repo"
    (root / "envdefs/base").mkdir(parents=True)
    (root / "envdefs/workspaces").mkdir()
    (root / "sources/app").mkdir(parents=True)
    (root / "sources/app/a.py").write_text("x = 1\n")
    (root / "envdefs/base/deb.yaml").write_text(textwrap.dedent(BASE).lstrip())
    (root / "envdefs/workspaces/app.yaml").write_text(
        textwrap.dedent(WS.format(name="app", path="../../sources/app")).lstrip())
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "one")
    monkeypatch.chdir(root)
    return root


def keys_error(repo, tmp_path, rev="HEAD") -> str:
    with pytest.raises(SourceError) as e:
        keys_at_revision(repo / "envdefs", rev, None, ParseCache(tmp_path / "parse"))
    return "\n".join(e.value.render_lines())


def test_symlinked_definition_at_rev_is_not_followed(repo, tmp_path):
    os.symlink("/etc/passwd", repo / "envdefs/workspaces/evil.yaml")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "evil")
    (repo / "envdefs/workspaces/evil.yaml").unlink()
    text = keys_error(repo, tmp_path)
    assert "HEAD:envdefs/workspaces/evil.yaml" in text and "is a symlink" in text
    assert "root:" not in text  # nothing of the target was read


def test_option_looking_rev_is_refused(repo, tmp_path):
    out = tmp_path / "written"
    text = keys_error(repo, tmp_path, rev=f"--output={out}")
    assert "unknown git revision" in text
    assert not out.exists()


def test_huge_blob_at_rev_is_one_problem(repo, tmp_path):
    big = repo / "envdefs/workspaces/big.yaml"
    big.write_bytes(b"# " + b"x" * MAX_YAML_BYTES + b"\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "big")
    big.unlink()
    text = keys_error(repo, tmp_path)
    assert "HEAD:envdefs/workspaces/big.yaml" in text and "over the 8 MiB limit" in text


def test_source_path_out_of_the_repository_at_rev_is_refused(repo, tmp_path):
    (repo / "envdefs/workspaces/out.yaml").write_text(
        textwrap.dedent(WS.format(name="out", path="../../../../../../../etc")).lstrip())
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "out")
    (repo / "envdefs/workspaces/out.yaml").unlink()
    text = keys_error(repo, tmp_path)
    assert "outside the source root" in text
