"""``plan --changed-since REV`` / ``explain --against REV`` in a real temporary git repository,
and git sources pinned with real ``git`` (local path and file:// URL)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from types import MappingProxyType

import pytest

from envbuild.build.pin import pin_inputs
from envbuild.cli.main import main
from envbuild.defs.model import DefinitionSet, Origin, Workspace
from envbuild.errors import SourceError
from tests.conftest import require_tool

pytestmark = pytest.mark.integration

TREE = {
    "envdefs/base/deb.yaml": """
        apiVersion: envbuild/v1
        kind: Base
        name: deb
        abi: deb12
        from: {debootstrap: {suite: bookworm}}
        steps:
          - run: apt-get install -y python3
        """,
    "envdefs/workspaces/app.yaml": """
        apiVersion: envbuild/v1
        kind: Workspace
        name: app
        build_on: deb
        source: {path: ../../sources/app}
        steps:
          - run: pip install -e /workspace
        """,
    "envdefs/workspaces/other.yaml": """
        apiVersion: envbuild/v1
        kind: Workspace
        name: other
        build_on: deb
        source: {path: ../../sources/other}
        """,
    "envdefs/toolkits/rg.yaml": """
        apiVersion: envbuild/v1
        kind: Toolkit
        name: rg
        build_on: deb
        prefix: /opt/toolkits/rg
        steps:
          - run: apt-get install x
        """,
    "envdefs/envs/swe.yaml": """
        apiVersion: envbuild/v1
        kind: Env
        name: swe
        base: deb
        workspace: app
        toolkits: [rg]
        """,
    "envdefs/envs/swe-other.yaml": """
        apiVersion: envbuild/v1
        kind: Env
        name: swe-other
        base: deb
        workspace: other
        """,
    "sources/app/app.py": "print('hi')\n",
    "sources/app/run.sh": "#!/bin/sh\n",
    "sources/other/o.py": "x = 1\n",
}


def git(cwd, *argv):
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def write(root, rel, text):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(textwrap.dedent(text).lstrip())


@pytest.fixture
def repo(tmp_path, monkeypatch):
    require_tool("git")
    root = tmp_path / "repo"
    for rel, text in TREE.items():
        write(root, rel, text)
    (root / "sources/app/run.sh").chmod(0o755)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.chdir(root)
    return root


def plan_since(capsys, rev="HEAD", *extra):
    code = main(["--defs", "envdefs", "plan", "--json", "--changed-since", rev, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_nothing_changed(repo, capsys):
    doc = plan_since(capsys)
    assert doc["rebuild"] == [] and doc["relock"] == []
    assert len(doc["layers"]) == 4  # the plan itself is still there


def test_base_step_change_rebuilds_only_the_base_and_relocks_its_envs(repo, capsys):
    p = repo / "envdefs/base/deb.yaml"
    p.write_text(p.read_text().replace("python3", "python3 git"))
    doc = plan_since(capsys)
    assert doc["rebuild"] == ["deb"]  # app, other and rg key on deb's abi: reused (O(m))
    assert doc["relock"] == ["swe", "swe-other"]


def test_source_change_outside_envdefs(repo, capsys):
    (repo / "sources/app/app.py").write_text("print('bye')\n")
    doc = plan_since(capsys)
    assert doc["rebuild"] == ["app"] and doc["relock"] == ["swe"]


def test_mode_change_and_new_untracked_definitions(repo, capsys):
    (repo / "sources/app/run.sh").chmod(0o644)
    write(repo, "envdefs/toolkits/fd.yaml", """
        apiVersion: envbuild/v1
        kind: Toolkit
        name: fd
        build_on: deb
        prefix: /opt/toolkits/fd
        """)
    doc = plan_since(capsys)
    assert doc["rebuild"] == ["app", "fd"] and doc["relock"] == ["swe"]


def test_targets_limit_the_report(repo, capsys):
    (repo / "sources/app/app.py").write_text("print('bye')\n")
    (repo / "sources/other/o.py").write_text("x = 2\n")
    doc = plan_since(capsys, "HEAD", "swe-other")
    assert doc["rebuild"] == ["other"] and doc["relock"] == ["swe-other"]


def commit(root, msg):
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-a", "-m", msg)


def test_explain_against_names_the_changed_input(repo, capsys):
    p = repo / "envdefs/toolkits/rg.yaml"
    p.write_text(p.read_text().replace("install x", "install x y"))
    commit(repo, "two")
    code = main(["--defs", "envdefs", "explain", "rg", "--against", "HEAD~1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "steps[0].run: 'apt-get install x' -> 'apt-get install x y'" in out
    doc = plan_since(capsys, "HEAD~1")
    assert doc["rebuild"] == ["rg"] and doc["relock"] == ["swe"]
    code = main(["--defs", "envdefs", "explain", "swe", "--against", "HEAD~1"])
    out, _ = capsys.readouterr()
    assert "layers[2].key:" in out


def test_working_tree_and_index_are_untouched(repo, capsys):
    (repo / "sources/app/app.py").write_text("print('bye')\n")
    git(repo, "add", "sources/app/app.py")
    before = git(repo, "status", "--porcelain=v1"), git(repo, "worktree", "list")
    plan_since(capsys)
    assert (git(repo, "status", "--porcelain=v1"), git(repo, "worktree", "list")) == before


def test_defs_dir_missing_at_rev_means_everything_is_new(repo, capsys):
    write(repo, "README", "x\n")
    git(repo, "rm", "-q", "-r", "--cached", "envdefs", "sources")
    git(repo, "add", "README")
    commit(repo, "no defs")
    doc = plan_since(capsys)
    assert doc["rebuild"] == ["app", "deb", "other", "rg"]
    assert doc["relock"] == ["swe", "swe-other"]


def test_unknown_revision_is_a_user_error(repo, capsys):
    code = main(["--defs", "envdefs", "plan", "--changed-since", "no-such-rev"])
    _, err = capsys.readouterr()
    assert code == 1 and "unknown git revision 'no-such-rev'" in err


# ---------------------------------------------------------------------- git sources


def git_defs(tmp_path, url, rev):
    origin = Origin(file=str(tmp_path / "envdefs" / "w.yaml"), line=3, column=1,
                    field_positions=MappingProxyType({"source": (5, 9)}))
    w = Workspace.from_mapping({"name": "w", "build_on": "b",
                                "source": {"git": {"url": url, "rev": rev}}}, origin)
    return DefinitionSet(root=str(tmp_path), by_name=MappingProxyType({"w": w}))


def test_git_sources_pin_to_commit_shas(repo, tmp_path):
    head = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "tag", "-a", "-m", "v", "v1")
    for url in (os.path.relpath(repo, tmp_path / "envdefs"), f"file://{repo}"):
        for rev in ("main", "v1", head[:10], "HEAD"):
            assert pin_inputs(git_defs(tmp_path, url, rev))["w"]["source"] == head, (url, rev)


def test_bad_git_rev_is_a_source_error_at_the_line(repo, tmp_path):
    with pytest.raises(SourceError) as info:
        pin_inputs(git_defs(tmp_path, f"file://{repo}", "no-such-branch"))
    assert "w.yaml:5:9" in info.value.message and "no-such-branch" in info.value.hint


def test_broken_definitions_at_rev_are_reported_against_the_rev(repo, capsys):
    p = repo / "envdefs/toolkits/rg.yaml"
    p.write_text(p.read_text().replace("build_on: deb", "build_on: dbe"))
    commit(repo, "broken")
    p.write_text(p.read_text().replace("build_on: dbe", "build_on: deb"))
    code = main(["--defs", "envdefs", "plan", "--changed-since", "HEAD"])
    _, err = capsys.readouterr()
    assert code == 1
    assert "the definitions at HEAD cannot be keyed" in err
    assert "HEAD:envdefs/toolkits/rg.yaml:4:11: build_on 'dbe'" in err



def _archive_workspace(repo, data: bytes) -> str:
    """A workspace reading ``sources/big.tar`` (not committed: ignored by git) pinned by
    sha256 in its YAML, which is committed; returns the sha256."""
    import hashlib

    (repo / "sources/big.tar").write_bytes(data)
    (repo / ".gitignore").write_text("*.tar\n")
    digest = hashlib.sha256(data).hexdigest()
    write(repo, "envdefs/workspaces/big.yaml", f"""
        apiVersion: envbuild/v1
        kind: Workspace
        name: big
        build_on: deb
        pin: digest
        source: {{archive: {{path: ../../sources/big.tar, sha256: {digest}}}}}
        """)
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "big")
    assert "big.tar" not in git(repo, "ls-files")
    return digest


def _keys_three_ways(repo, tmp_path):
    """REV's keys by the full checkout, from git objects, and as a delta of the working tree."""
    from envbuild.build.gitrev import keys_at_revision, keys_at_revision_checkout
    from envbuild.build.pin import Pinner, snapshot
    from envbuild.defs.parsecache import RACY_NS, ParseCache

    defs = repo / "envdefs"
    slow = keys_at_revision_checkout(defs, "HEAD", Pinner())
    objects = keys_at_revision(defs, "HEAD", Pinner())
    cache = ParseCache(tmp_path / "cache")
    cache.started_ns += 10 * RACY_NS
    pinner = Pinner()
    delta = keys_at_revision(defs, "HEAD", pinner, cache, snapshot(defs, pinner, cache))
    return [dict(k.layers) for k in (slow, objects, delta)]


def test_an_uncommitted_archive_pinned_by_sha256_plans_since_a_rev(repo, capsys, tmp_path):
    """The sha256 in the YAML pins the archive's content, so an archive git does not have
    (too big to commit, ignored) is read from the working tree for REV too (issue 38)."""
    _archive_workspace(repo, b"archive bytes\n" * 100)
    doc = plan_since(capsys)
    assert doc["rebuild"] == [] and doc["relock"] == []
    p = repo / "envdefs/base/deb.yaml"
    p.write_text(p.read_text().replace("python3", "python3 git"))
    doc = plan_since(capsys)
    assert doc["rebuild"] == ["big", "deb"], doc  # big pins deb by digest
    slow, objects, delta = _keys_three_ways(repo, tmp_path)
    assert slow == objects == delta and "big" in slow


def test_an_uncommitted_archive_that_does_not_match_rev_is_one_clear_error(repo, capsys):
    """The working tree's archive was replaced (and its sha256 in the YAML with it): REV's
    archive is nowhere, which is said in one line with what to do."""
    import hashlib

    old = _archive_workspace(repo, b"archive bytes\n" * 100)
    new = hashlib.sha256(b"other bytes\n").hexdigest()
    (repo / "sources/big.tar").write_bytes(b"other bytes\n")
    p = repo / "envdefs/workspaces/big.yaml"
    p.write_text(p.read_text().replace(old, new))
    code = main(["--defs", "envdefs", "plan", "--changed-since", "HEAD"])
    _out, err = capsys.readouterr()
    assert code == 1, err
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "big.yaml" in ln)
    assert line.startswith("error: HEAD:envdefs/workspaces/big.yaml:"), err
    assert "../../sources/big.tar is not in the revision's tree" in line, err
    assert f"declared sha256:{old}, file has sha256:{new}" in line, err
    assert "hint: commit the file" in err, err


TASK = """
    apiVersion: envbuild/v1
    kind: Task
    name: fix-app
    env: swe
    workdir: /workspace
    hidden: {path: hidden}
    grade: {run: python3 -m pytest -q, timeout: 60}
    """


@pytest.mark.parametrize("commit_task", [True, False])
def test_a_task_in_the_tree_is_planned_with_its_hidden_key(repo, capsys, commit_task):
    # issue 35: a Task depends on its env; a change below it makes it dirty; its hidden layer
    # is keyed over the env's layers, so a changed layer gives it a new key
    write(repo, "envdefs/tasks/fix-app.yaml", TASK)
    write(repo, "envdefs/tasks/hidden/test_hidden.py", "def test_x(): pass\n")
    if commit_task:
        git(repo, "add", ".")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "task")
    (repo / "sources/app/app.py").write_text("print('bye')\n")
    doc = plan_since(capsys)
    assert doc["rebuild"] == ["app"] and doc["relock"] == ["swe"]
    [task] = doc["tasks"]
    assert (task["name"], task["env"], task["hidden"]["status"]) == ("fix-app", "swe", "missing")
    before = task["hidden"]["key"]
    (repo / "sources/app/app.py").write_text("print('bye again')\n")
    assert plan_since(capsys)["tasks"][0]["hidden"]["key"] != before
    t = repo / "envdefs/tasks/fix-app.yaml"
    t.write_text(t.read_text().replace("timeout: 60", "timeout: 90"))
    doc = plan_since(capsys, "HEAD", "fix-app")
    assert doc["rebuild"] == ["app"] and doc["relock"] == ["swe"]
