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


def test_dot_dot_tree_entries_at_rev_make_nothing_outside(repo, tmp_path):
    """A crafted commit (``git mktree`` does not check names) with ``..`` entries under the
    defs dir: nothing is made outside the temporary directory (both the hidden-directory rule
    and the name check in load_revision refuse such names), the rest is keyed."""
    escape = f"h15-escape-{os.getpid()}"

    def mktree(entries: str) -> str:
        return subprocess.run(["git", "mktree"], cwd=repo, input=entries, check=True,
                              capture_output=True, text=True).stdout.strip()

    blob = subprocess.run(["git", "hash-object", "-w", "envdefs/base/deb.yaml"], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()
    inner = mktree(f"100644 blob {blob}\tx.yaml\n")
    inner = mktree(f"040000 tree {inner}\t{escape}\n")
    for _ in range(6):
        inner = mktree(f"040000 tree {inner}\t..\n")
    head = git(repo, "rev-parse", "HEAD:envdefs").strip()
    listing = git(repo, "ls-tree", head)
    envdefs = mktree(listing + f"040000 tree {inner}\t..\n")
    top = mktree(git(repo, "ls-tree", "HEAD").replace(head, envdefs))
    commit = git(repo, "commit-tree", top, "-p", "HEAD", "-m", "crafted").strip()
    keys = keys_at_revision(repo / "envdefs", commit, None, ParseCache(tmp_path / "parse"))
    assert set(keys.layers) == {"deb", "app"}
    for up in ("/", "/tmp", str(tmp_path), str(repo)):
        assert not os.path.exists(os.path.join(up, escape))
