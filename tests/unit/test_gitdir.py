"""The pure parts of a shipped ``.git`` (``envbuild.build.gitdir``): its small files, the
history cut, the members' time, and a tar whose bytes depend on the contents only."""

from __future__ import annotations

import os
import tarfile

from envbuild.build import gitdir
from envbuild.defs.model import GitSource, workspace_source_from_mapping

C1 = "a" * 40
C256 = "b" * 64
ROOT = f"tree {'c' * 40}\nauthor a <a@a> 1700000000 +0000\ncommitter a <a@a> 1700000100 +0200\n\nmsg\n"
CHILD = ROOT.replace("\nauthor", f"\nparent {'d' * 40}\nauthor")


def test_small_files_of_a_root_commit_have_no_shallow():
    files = gitdir.small_files(C1, ROOT)
    assert files == {"HEAD": b"ref: refs/heads/main\n", "refs/heads/main": f"{C1}\n".encode(),
                     "config": gitdir.config_text(C1).encode()}


def test_a_commit_with_parents_is_marked_shallow():
    assert gitdir.has_parents(CHILD) and not gitdir.has_parents(ROOT)
    assert gitdir.small_files(C1, CHILD)["shallow"] == f"{C1}\n".encode()
    # "parent" in the message is not a parent
    assert not gitdir.has_parents(ROOT + "\nparent of something\n")


def test_config_is_minimal_and_knows_sha256():
    text = gitdir.config_text(C1)
    assert "remote" not in text and "hooks" not in text and "repositoryformatversion = 0" in text
    assert "objectformat = sha256" in gitdir.config_text(C256)


def test_commit_time_is_the_committers():
    assert gitdir.commit_time(ROOT) == 1700000100
    assert gitdir.commit_time("tree x\n\n") == 0


def test_dotgit_tar_depends_on_contents_only(tmp_path):
    def make(root, mode):
        (root / "objects" / "pack").mkdir(parents=True)
        (root / "HEAD").write_text("ref: refs/heads/main\n")
        (root / "objects" / "pack" / "p.pack").write_bytes(b"PACK")
        os.chmod(root / "HEAD", mode)

    a, b = tmp_path / "a", tmp_path / "b"
    make(a, 0o600)
    make(b, 0o664)
    os.utime(b / "HEAD", (1, 1))
    gitdir.write_dotgit_tar(a, tmp_path / "a.tar", 5)
    gitdir.write_dotgit_tar(b, tmp_path / "b.tar", 5)
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [".git", ".git/HEAD", ".git/objects",
                                         ".git/objects/pack", ".git/objects/pack/p.pack"]
    assert {(m.uid, m.gid, m.mtime) for m in members} == {(0, 0, 5)}


def test_dotgit_is_opt_in_and_keeps_the_key_without_it():
    plain = workspace_source_from_mapping({"git": {"url": "u", "rev": "main"}})
    off = workspace_source_from_mapping({"git": {"url": "u", "rev": "main", "dotgit": False}})
    on = workspace_source_from_mapping({"git": {"url": "u", "rev": "main", "dotgit": True}})
    assert plain == off == GitSource(url="u", rev="main")
    assert plain.identity() == off.identity() == {"git": {"url": "u"}}
    assert on.identity() == {"git": {"url": "u", "dotgit": True}}


def test_dotgit_with_strip_components_is_refused_at_load(tmp_path):
    import pytest

    from envbuild.defs import load_definitions
    from envbuild.errors import DefinitionError

    d = tmp_path / "defs"
    d.mkdir()
    body = ("apiVersion: envbuild/v1\nkind: Workspace\nname: w\nbuild_on: b\n"
            "source: {git: {url: https://example.invalid/r.git, rev: main, dotgit: true, "
            "strip_components: %d}}\n")
    (d / "w.yaml").write_text(body % 1)
    with pytest.raises(DefinitionError) as info:
        load_definitions(str(d))
    (problem,) = info.value.problems
    assert "strip_components" in problem.render() and "dotgit" in problem.render()
    (d / "w.yaml").write_text(body % 0)
    assert load_definitions(str(d)).by_name["w"].source.dotgit
