"""``source: {git: …, dotgit: true}`` through a real build and real git: the layer's ``.git``
holds the pinned commit and nothing else (a later fix is not recoverable by ``git log --all``,
``git fsck --lost-found``, ``git cat-file --batch-all-objects`` or the pack files), the tree is
clean at start, an edit shows in ``git diff``, and a rebuild gives the same layer digest."""

from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from pathlib import Path

from envbuild.layers import LayerReader
from envbuild.store import LocalStore, get_key_record
from tests.conftest import require_tool
from tests.integration.test_importers import _build_ok, _git, _write

FIX = "the secret fix 7f3a\n"


def _two_commit_repo(root: Path) -> tuple[Path, str, str]:
    repo = root / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "dev")
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (repo / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(repo / "run.sh", 0o755)
    (repo / ".gitattributes").write_text("VERSION export-subst\nignored.txt export-ignore\n"
                                         "*.crlf text eol=crlf\n")
    (repo / "notes.crlf").write_text("line one\nline two\n")
    os.symlink("pkg/mod.py", repo / "link")
    (repo / "VERSION").write_text("$Format:%H$\n")
    (repo / "ignored.txt").write_text("kept in a checkout\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "zero")
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    _git(repo, "commit", "-q", "-am", "one")
    pinned = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "mod.py").write_text(FIX)
    _git(repo, "commit", "-q", "-am", "the fix")
    _git(repo, "tag", "v2")
    fix = _git(repo, "rev-parse", "HEAD")
    return repo, pinned, fix


def _layer_key(cli, name: str) -> str:
    plan = cli("plan", "--json").json()
    return next(lay["key"] for lay in plan["layers"] if lay["name"] == name)


def _unpack(cli, key: str, dest: Path) -> str:
    """Write the layer's files under ``dest`` (modes kept); return the layer digest."""
    store = LocalStore(cli.store)
    record = get_key_record(store, key)
    assert record is not None
    with LayerReader.open_file(store.blob_path(record.layer)) as r:
        for e in r.entries():
            p = dest / e.path
            if e.type == "dir":
                p.mkdir(parents=True, exist_ok=True)
            elif e.type == "file":
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(r.read(e.path))
                os.chmod(p, e.mode & 0o777)
            elif e.type == "symlink":
                p.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(e.linkname, p)
    return record.layer


def _g(work: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work.parent), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@a",
           "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@a"}
    return subprocess.run(["git", "-C", str(work), *args], capture_output=True, text=True,
                          env=env)


def _ok(work: Path, *args: str) -> str:
    done = _g(work, *args)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def test_dotgit_workspace_has_the_pinned_commit_only(envbuild_cli, tmp_path):
    require_tool("git")
    repo, pinned, fix = _two_commit_repo(tmp_path)
    _write(tmp_path / "envdefs" / "workspaces" / "gitws.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: gitws
        build_on: busybox-tiny
        source: {{git: {{url: "../../repo", rev: {pinned}, dotgit: true}}}}
        dest: /src
        """)
    _build_ok(envbuild_cli, "gitws")
    key = _layer_key(envbuild_cli, "gitws")
    digest = _unpack(envbuild_cli, key, tmp_path / "root")
    work = tmp_path / "root" / "src"
    dotgit = work / ".git"

    # the commit, checked out on main; the working tree is what a checkout holds
    assert _ok(work, "rev-parse", "HEAD").strip() == pinned
    assert _ok(work, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert _ok(work, "log", "-1", "--format=%s").strip() == "one"
    assert (work / "pkg" / "mod.py").read_text() == "def f():\n    return 2\n"
    assert (work / "VERSION").read_text() == "$Format:%H$\n"
    assert (work / "ignored.txt").is_file()
    assert os.access(work / "run.sh", os.X_OK)
    assert (work / "notes.crlf").read_bytes() == b"line one\r\nline two\r\n"
    assert os.readlink(work / "link") == "pkg/mod.py"

    # clean at start, from an index with no stat data (before git status refreshes it)
    debug = _ok(work, "ls-files", "--debug")
    stat = [ln.strip() for ln in debug.splitlines() if ln.startswith("  ")]
    assert stat and set(stat) == {"ctime: 0:0", "mtime: 0:0", "dev: 0\tino: 0",
                                  "uid: 0\tgid: 0", "size: 0\tflags: 0"}, stat
    assert _ok(work, "status", "--porcelain") == ""
    assert _ok(work, "diff") == ""
    # the shipped .git: nothing but these files
    files = sorted(p.relative_to(dotgit).as_posix() for p in dotgit.rglob("*") if p.is_file())
    pack = [f for f in files if f.startswith("objects/pack/")]
    assert len(pack) == 2 and {f.rsplit(".", 1)[1] for f in pack} == {"pack", "idx"}
    assert [f for f in files if f not in pack] == ["HEAD", "config", "index", "refs/heads/main",
                                                   "shallow"]
    assert (dotgit / "shallow").read_text() == f"{pinned}\n"
    assert "remote" not in (dotgit / "config").read_text()

    # no trace of the fix, by each way an agent could look
    assert fix not in _ok(work, "log", "--all", "--format=%H")
    assert _ok(work, "for-each-ref") == f"{pinned} commit\trefs/heads/main\n"
    lost = _g(work, "fsck", "--lost-found", "--no-reflogs", "--unreachable")
    assert lost.returncode == 0, lost.stderr
    assert "unreachable" not in lost.stdout and "dangling" not in lost.stdout
    every = _ok(work, "cat-file", "--batch-all-objects", "--batch-check").splitlines()
    reachable = _ok(work, "rev-list", "--objects", "HEAD").splitlines()
    assert sorted(line.split()[0] for line in every) == sorted(r.split()[0] for r in reachable)
    assert fix not in _ok(work, "cat-file", "--batch-all-objects", "--batch-check")
    _assert_not_in_pack_bytes(dotgit, FIX.encode())

    # an edit shows in git diff and git status
    (work / "pkg" / "mod.py").write_text("def f():\n    return 3\n")
    assert "+    return 3" in _ok(work, "diff")
    assert _ok(work, "status", "--porcelain") == " M pkg/mod.py\n"

    # a rebuild from scratch gives the same layer
    _rebuild_same(envbuild_cli, tmp_path, key, digest)


def _assert_not_in_pack_bytes(dotgit: Path, secret: bytes) -> None:
    """Read the pack as an agent could: the raw bytes and every zlib stream in them."""
    for p in (dotgit / "objects").rglob("*"):
        if not p.is_file():
            continue
        data = p.read_bytes()
        assert secret not in data
        for i in range(len(data)):
            if data[i] == 0x78:  # a zlib header byte: try a stream from here
                try:
                    assert secret not in zlib.decompressobj().decompress(data[i:])
                except zlib.error:
                    pass


def _rebuild_same(cli, tmp_path: Path, key: str, digest: str) -> None:
    """A second store and build of the same definition: the same key and layer digest."""
    store2 = tmp_path / "store2"
    cli.store, cli.node = store2, tmp_path / "node2"
    report = _build_ok(cli, "gitws")
    assert {lay["name"]: lay["status"] for lay in report["layers"]}["gitws"] == "built"
    record = get_key_record(LocalStore(store2), key)
    assert record is not None and record.layer == digest


def test_default_git_source_keeps_its_key_and_ships_no_dotgit(envbuild_cli, tmp_path):
    require_tool("git")
    repo, pinned, _fix = _two_commit_repo(tmp_path)
    _write(tmp_path / "envdefs" / "workspaces" / "gitws.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: gitws
        build_on: busybox-tiny
        source: {{git: {{url: "../../repo", rev: {pinned}}}}}
        dest: /src
        """)
    plain = _layer_key(envbuild_cli, "gitws")
    _build_ok(envbuild_cli, "gitws")
    _unpack(envbuild_cli, plain, tmp_path / "root")
    assert not (tmp_path / "root" / "src" / ".git").exists()
    _write(tmp_path / "envdefs" / "workspaces" / "gitws.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: gitws
        build_on: busybox-tiny
        source: {{git: {{url: "../../repo", rev: {pinned}, dotgit: false}}}}
        dest: /src
        """)
    assert _layer_key(envbuild_cli, "gitws") == plain


def _git_toolkit(root: Path) -> None:
    """The host's git with its libraries and loader under ``root/bin``, ``root/lib``: a
    toolkit the busybox env can run git from (through the loader: busybox has no libc)."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    git = Path("/usr/bin/git").resolve()
    shutil.copy2(git, root / "bin" / "git")
    ldd = subprocess.run(["ldd", str(git)], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            shutil.copy2(Path(path).resolve(), root / "lib" / Path(path).name)


def test_dotgit_workspace_in_a_real_sandbox(envbuild_cli, tmp_path):
    """The layer as an agent sees it: in a runc sandbox (files owned as the layer says, other
    inodes and times than at build), git reads the tree clean, finds no trace of the fix,
    and shows an edit."""
    require_tool("git")
    require_tool("ldd")
    from runtime_shim import Sandbox

    _repo, pinned, fix = _two_commit_repo(tmp_path)
    defs = tmp_path / "envdefs"
    _git_toolkit(defs / "toolkits" / "files" / "git")
    _write(defs / "toolkits" / "gitbin.yaml", """\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: gitbin
        build_on: busybox-tiny
        requires: {abi: [busybox-amd64]}
        prefix: /opt/toolkits/git
        steps:
          - copy: {src: files/git, dest: /opt/toolkits/git}
        """)
    _write(defs / "workspaces" / "gitws.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: gitws
        build_on: busybox-tiny
        source: {{git: {{url: "../../repo", rev: {pinned}, dotgit: true}}}}
        dest: /src
        """)
    _write(defs / "envs" / "gitenv.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: gitenv
        base: busybox-tiny
        workspace: gitws
        toolkits: [gitbin]
        config: {workdir: /src, user: "0:0"}
        """)
    _build_ok(envbuild_cli, "gitenv")
    git = ("/opt/toolkits/git/lib/ld-linux-x86-64.so.2 --library-path /opt/toolkits/git/lib "
           "/opt/toolkits/git/bin/git -c core.pager=cat")
    with Sandbox.create("env/gitenv", store=LocalStore(envbuild_cli.store),
                        node_dir=envbuild_cli.node) as sb:
        def run(cmd: str) -> str:
            done = sb.exec(f"cd /src && {git} {cmd}")
            assert done.exit_code == 0, (cmd, done.stderr.decode())
            return done.stdout.decode()

        assert run("status --porcelain") == ""
        assert run("diff") == ""
        assert run("rev-parse HEAD").strip() == pinned
        assert run("log --format=%H").strip() == pinned
        assert fix not in run("log --all --format=%H")
        # (commit-graph and multi-pack-index checks run git anew: not through the loader)
        lost = run("-c core.commitGraph=false -c core.multiPackIndex=false "
                   "fsck --lost-found --unreachable --no-reflogs")
        assert fix not in lost and "unreachable" not in lost
        assert fix not in run("cat-file --batch-all-objects --batch-check")
        assert sb.exec("cat /src/.git/objects/pack/*.pack | grep -c 'secret fix'").stdout \
            .decode().strip() == "0"
        sb.exec("echo '# edited' >> /src/pkg/mod.py")
        assert "+# edited" in run("diff")
        assert run("status --porcelain") == " M pkg/mod.py\n"
        # how SWE harnesses submit: stage everything, diff against HEAD
        run("add -A")
        assert "+# edited" in run("diff --cached")
