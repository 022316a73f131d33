"""``strip_components:`` on archive and git sources, and ``envbuild check`` with per-command
timeouts, output tails, runner summaries and ``--jobs``, through the real CLI, runc and git
(busybox base: seconds)."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import require_tool

pytestmark = pytest.mark.integration


def _sdist(path: Path, top: str, files: dict[str, str]) -> str:
    """A gzip tarball laid out like a PyPI sdist (everything under ``top/``); its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in {**{f"{top}/": ""}, **{f"{top}/{k}": v for k, v in files.items()}}.items():
            ti = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
            else:
                data = text.encode()
                ti.size, ti.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
                tf.addfile(ti, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _git_repo(path: Path) -> str:
    require_tool("git")
    (path / "proj-main" / "tests").mkdir(parents=True)
    (path / "proj-main" / "VERSION").write_text("from-git\n")
    (path / "proj-main" / "tests" / "run.sh").write_text("echo 'git: 1 passed, 0 failed'\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    for argv in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True, env=env)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()


def _tree(defs: Path, tmp_path: Path, *, strip: int = 1) -> None:
    sha = _sdist(defs / "workspaces" / "pkg-1.0.tar.gz", "pkg-1.0", {
        "VERSION": "1.0\n",
        # what a real runner prints last; the check shows it
        "tests/run.sh": "#!/bin/sh\nset -e\ntest \"$(cat /workspace/VERSION)\" = 1.0\n"
                        "echo '====== 3 passed, 1 skipped in 0.01s ======'\n",
    })
    commit = _git_repo(tmp_path / "gitsrc")
    _write(defs / "workspaces" / "pkg.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: pkg
        build_on: busybox-tiny
        source: {{archive: {{path: pkg-1.0.tar.gz, sha256: "{sha}", strip_components: {strip}}}}}
        dest: /workspace
        check:
          - sh /workspace/tests/run.sh
          - {{run: "echo before-the-deadline; sleep 30", timeout: 2}}
          - {{run: "echo some output; echo the last line >&2; exit 3"}}
        """)
    _write(defs / "workspaces" / "gitpkg.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: gitpkg
        build_on: busybox-tiny
        source: {{git: {{url: {tmp_path / 'gitsrc'}, rev: {commit}, strip_components: 1}}}}
        dest: /workspace
        check:
          - run: test "$(cat /workspace/VERSION)" = from-git && sh /workspace/tests/run.sh
            timeout: 60
        """)
    for env, ws in (("pkg-env", "pkg"), ("gitpkg-env", "gitpkg")):
        _write(defs / "envs" / f"{env}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Env
            name: {env}
            base: busybox-tiny
            workspace: {ws}
            toolkits: [shtest]
            """)


def test_strip_components_and_check_output(envbuild_cli, tmp_path):
    defs = envbuild_cli.defs
    _tree(defs, tmp_path)
    built = envbuild_cli("build", "--json")
    assert built.code == 0, built.err
    listed = envbuild_cli("run", "pkg-env", "--", "ls", "/workspace")
    assert listed.code == 0 and listed.out.split() == ["VERSION", "tests"], listed.out
    listed = envbuild_cli("run", "gitpkg-env", "--", "ls", "/workspace")
    assert listed.code == 0 and listed.out.split() == ["VERSION", "tests"], listed.out

    started = time.monotonic()
    checked = envbuild_cli("check", "--jobs", "2", "pkg-env", "gitpkg-env", "busybox-shell")
    assert time.monotonic() - started < 25  # the 2 s timeout really killed `sleep 30`
    assert checked.code == 1, checked.out + checked.err
    lines = checked.out.splitlines()
    ok = [ln for ln in lines if ln.startswith("ok ")]
    # a passing check shows the runner's summary line
    assert any("pkg-env" in ln and "[3 passed, 1 skipped in 0.01s]" in ln for ln in ok), lines
    assert any("gitpkg-env" in ln and "[1 passed, 0 failed]" in ln for ln in ok), lines
    timed = next(i for i, ln in enumerate(lines) if ln.startswith("FAIL") and "sleep 30" in ln)
    assert "(timed out after 2s)" in lines[timed]
    assert lines[timed + 1] == "     | before-the-deadline"  # the tail of what it printed
    failed = next(i for i, ln in enumerate(lines) if ln.startswith("FAIL") and "exit 3" in ln)
    assert lines[failed + 1:failed + 3] == ["     | some output", "     | the last line"]
    # one result line per env, whatever order they finished in
    assert "env pkg-env: FAILED (1/3 checks passed" in checked.out
    assert "env gitpkg-env: ok (1/1 checks passed" in checked.out
    assert "env busybox-shell: ok (1/1 checks passed" in checked.out
    assert lines[-1] == "3 passed, 2 failed"


def test_a_strip_that_loses_files_fails_the_build_and_publishes_nothing(envbuild_cli, tmp_path):
    defs = envbuild_cli.defs
    _tree(defs, tmp_path, strip=2)  # pkg-1.0/VERSION has no third component
    built = envbuild_cli("build", "pkg-env")
    assert built.code == 1
    assert "strip_components 2 leaves nothing of file 'pkg-1.0/VERSION'" in built.err, built.err
    assert "Traceback" not in built.err
    assert envbuild_cli("run", "pkg-env", "--", "true").code == 1  # no lock was written
