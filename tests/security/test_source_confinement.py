"""Host files in layers (issue 34, item 5): every path a definition names (``rootfs``,
``archive``, ``oci`` layouts, ``busybox`` binaries, local and ``file://`` git URLs, besides
``copy``/``path`` and Dockerfile contexts, tested in ``test_build_inputs`` and
``test_dockerfile_inputs``) must resolve inside the source root, unless the one running the
build names a trusted directory (``--trust-sources DIR`` / ``ENVBUILD_TRUSTED_SOURCES``).

Each attack goes through the real CLI and asserts the secure outcome: one line naming the
definition's file, exit 1, nothing published, and the host's file in no layer.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest

from envbuild.store import LocalStore
from tests.conftest import require_tool
from tests.security.test_build_inputs import _oci_layout, _tar_bytes

SECRET = b"root:$6$host-secret-hash:19000:0:99999:7:::\n"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _published(cli) -> set[str]:
    keys = Path(cli.store) / "keys"
    return {p.name for p in keys.rglob("*") if p.is_file()} if keys.exists() else set()


def _layers_holding(cli, needle: bytes) -> list[str]:
    """Files of the layers published in the CLI's store whose contents hold ``needle``."""
    from envbuild.layers import LayerReader
    from envbuild.store import get_key_record

    store = LocalStore(cli.store)
    found = []
    for key in _published(cli):
        record = get_key_record(store, "sha256:" + key)
        with LayerReader.open_file(store.blob_path(record.layer)) as r:
            found += [e.path for e in r.entries() if e.type == "file" and needle in r.read(e.path)]
    return found


def _one_line_refusal(result, file: str) -> None:
    assert result.code == 1, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "this is a bug" not in result.err, result.err
    first = result.err.strip().splitlines()[0]
    assert file in first and "outside the source root" in first, result.err


@pytest.fixture(autouse=True)
def _no_trust(monkeypatch):
    """No trusted directory unless a test names one; restored after the test (the CLI's
    ``--trust-sources`` sets the variable for the commands it runs, in this process)."""
    monkeypatch.setenv("ENVBUILD_TRUSTED_SOURCES", "")


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory beside the repository (not in it) holding a host secret, as a tarball, an
    OCI layout and a git repository: what a hostile definition would like in its layer."""
    out = tmp_path.parent / f"{tmp_path.name}-host"
    (out / "etc").mkdir(parents=True)
    (out / "etc" / "shadow").write_bytes(SECRET)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("etc/shadow")
        info.size = len(SECRET)
        tar.addfile(info, io.BytesIO(SECRET))
    (out / "root.tar.gz").write_bytes(buf.getvalue())
    return out


def _git_repo(path: Path) -> str:
    require_tool("git")
    path.mkdir(parents=True)
    (path / "shadow").write_bytes(SECRET)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q", "-b", "main"], ["add", "shadow"], ["commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True, env=env,
                       capture_output=True)
    return "main"


def _base(tmp_path: Path, source: str) -> None:
    _write(tmp_path / "envdefs" / "base" / "evil.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Base
        name: evil
        abi: evil
        from: {source}
        """)


def _workspace(tmp_path: Path, source: str) -> None:
    _write(tmp_path / "envdefs" / "workspaces" / "evil.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: evil
        build_on: busybox-tiny
        source: {source}
        dest: /src
        """)


def _definition(kind: str, tmp_path: Path, outside: Path) -> None:
    """The hostile definition of ``kind``, naming a host path outside the repository."""
    sha = hashlib.sha256((outside / "root.tar.gz").read_bytes()).hexdigest()
    if kind == "rootfs-etc":  # the exact attack
        _base(tmp_path, "{rootfs: {path: /etc}}")
    elif kind == "rootfs-dir":
        _base(tmp_path, f"{{rootfs: {{path: {outside}}}}}")
    elif kind == "rootfs-dotdot":
        rel = os.path.relpath(outside, tmp_path / "envdefs" / "base")
        _base(tmp_path, f"{{rootfs: {{path: {rel}}}}}")
    elif kind == "rootfs-symlink":
        os.symlink(outside, tmp_path / "envdefs" / "base" / "innocent")
        _base(tmp_path, "{rootfs: {path: innocent}}")
    elif kind == "rootfs-tarball":
        _base(tmp_path, f"{{rootfs: {{path: {outside}/root.tar.gz, sha256: {sha}}}}}")
    elif kind == "archive":
        _workspace(tmp_path, f"{{archive: {{path: {outside}/root.tar.gz, sha256: {sha}}}}}")
    elif kind == "oci":
        layer = _tar_bytes([("etc", "dir", None), ("etc/shadow", "file", SECRET)])
        _oci_layout(outside / "layout", [layer])
        _base(tmp_path, f"{{oci: {{layout: {outside}/layout, ref: v1}}}}")
    elif kind == "busybox":
        _base(tmp_path, f"{{busybox: {{binary: {outside}/etc/shadow}}}}")
    elif kind in ("git-path", "git-file-url"):
        rev = _git_repo(outside / "repo")
        url = str(outside / "repo") if kind == "git-path" else f"file://{outside}/repo"
        _workspace(tmp_path, f'{{git: {{url: "{url}", rev: {rev}}}}}')
    else:
        raise AssertionError(kind)


KINDS = ["rootfs-etc", "rootfs-dir", "rootfs-dotdot", "rootfs-symlink", "rootfs-tarball",
         "archive", "oci", "busybox", "git-path", "git-file-url"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_source_outside_the_repository_is_refused(envbuild_cli, tmp_path, outside, kind):
    _definition(kind, tmp_path, outside)
    before = _published(envbuild_cli)
    for command in (("build", "evil"), ("plan",)):
        result = envbuild_cli(*command)
        _one_line_refusal(result, "evil.yaml:")
        assert "--trust-sources" in result.err, result.err  # the hint names the opt-in
    assert _published(envbuild_cli) == before
    assert not _layers_holding(envbuild_cli, SECRET)


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("kind", ["rootfs-dir", "git-file-url"])
def test_a_trusted_directory_is_an_explicit_opt_in(envbuild_cli, tmp_path, outside, kind, how,
                                                   monkeypatch):
    """The node's operator (never the definition) names the directories it trusts; a
    source there builds, and only there: a sibling of the trusted directory stays refused."""
    _definition(kind, tmp_path, outside)
    trusted = outside / "repo" if kind.startswith("git") else outside
    if how == "env":
        monkeypatch.setenv("ENVBUILD_TRUSTED_SOURCES", str(trusted))
        result = envbuild_cli("build", "evil")
    else:
        result = envbuild_cli("--trust-sources", str(trusted), "build", "evil")
    assert result.code == 0, result.err
    assert _layers_holding(envbuild_cli, SECRET)
    monkeypatch.setenv("ENVBUILD_TRUSTED_SOURCES", "")
    result = envbuild_cli("--trust-sources", str(outside / "etc"), "plan")
    _one_line_refusal(result, "evil.yaml:")


def test_a_relative_trusted_directory_is_refused(envbuild_cli, tmp_path, outside):
    """Trust never depends on the working directory."""
    _definition("rootfs-dir", tmp_path, outside)
    result = envbuild_cli("--trust-sources", "relative/dir", "plan")
    assert result.code == 1 and "Traceback" not in result.err, result.err
    assert "absolute" in result.err, result.err


def test_busybox_etc_shadow_is_one_line(envbuild_cli, monkeypatch):
    """The issue's exact definition; and, trusted (``/etc``), still one line: the file is
    not a static ELF executable, and it is never executed."""
    _base(envbuild_cli.defs.parent, "{busybox: {binary: /etc/shadow}}")
    result = envbuild_cli("build", "evil")
    _one_line_refusal(result, "evil.yaml:")
    result = envbuild_cli("--trust-sources", "/etc", "build", "evil")
    assert result.code == 1 and "Traceback" not in result.err, result.err
    assert "not a static ELF executable" in result.err.strip().splitlines()[0], result.err


def test_a_busybox_binary_in_the_repository_is_never_run_on_the_host_unless_static_elf(
        envbuild_cli, tmp_path):
    """A script named as the busybox binary: the importer ran it as root on the host to
    list its applets. It is refused at the definition's line, and never run."""
    marker = tmp_path / "ran-on-host"
    script = tmp_path / "envdefs" / "base" / "files" / "busybox.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!/bin/sh\ntouch {marker}\necho bin/sh\n")
    script.chmod(0o755)
    _base(tmp_path, f"{{busybox: {{binary: {script}}}}}")
    result = envbuild_cli("build", "evil")
    assert not marker.exists(), "the definition's script ran on the host"
    assert result.code == 1 and "Traceback" not in result.err, result.err
    first = result.err.strip().splitlines()[0]
    assert "evil.yaml:" in first and "not a static ELF executable" in first, result.err


def test_the_host_busybox_package_binary_stays_allowed(envbuild_cli):
    """``/bin/busybox`` (the default, and what envdefs/base/busybox-tiny.yaml names) is the
    host's package binary: allowed without any opt-in."""
    require_tool("busybox")
    result = envbuild_cli("build", "busybox-tiny")
    assert result.code == 0, result.err


FAKE_BUSYBOX = r"""
#include <fcntl.h>
#include <stdio.h>
int main(void) {
    open(MARKER, O_CREAT | O_WRONLY, 0644);  /* on the host, if it ran there */
    fputs(LISTING, stdout);
    return 0;
}
"""


def _fake_busybox(tmp_path: Path, listing: str) -> tuple[Path, Path]:
    """A static ELF in the repository that says it is busybox: it prints ``listing`` and
    creates a marker file at a host path if it can."""
    require_tool("gcc")
    marker = tmp_path / "ran-on-host"
    src = tmp_path / "fake.c"
    src.write_text(FAKE_BUSYBOX)
    binary = tmp_path / "envdefs" / "base" / "files" / "fakebox"
    binary.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-static", "-O0", "-o", str(binary), str(src),
                    f'-DMARKER="{marker}"', f'-DLISTING="{listing}"'],  # C escapes: \\n
                   check=True, capture_output=True)
    return binary, marker


def test_a_static_busybox_from_the_repository_lists_its_applets_in_a_container(envbuild_cli,
                                                                              tmp_path):
    """The importer ran the binary as root on the host to list its applets: a static ELF
    in the definitions' repository ran there. It runs in a container now (read-only root, no
    network); what it prints still becomes the applet links."""
    binary, marker = _fake_busybox(tmp_path, "bin/sh\\nusr/bin/env\\n")
    _base(tmp_path, f"{{busybox: {{binary: {binary}}}}}")
    result = envbuild_cli("build", "evil")
    assert not marker.exists(), "the definition's binary ran on the host"
    assert result.code == 0, result.err
    from envbuild.layers import LayerReader
    from envbuild.store import get_key_record

    store = LocalStore(envbuild_cli.store)
    (key,) = _published(envbuild_cli)
    with LayerReader.open_file(store.blob_path(get_key_record(store, "sha256:" + key).layer)) as r:
        assert r.stat("bin/sh").type == "symlink" and r.stat("usr/bin/env").type == "symlink"


@pytest.mark.parametrize("printed", ["{up}{tmp}/escaped", "{tmp}/escaped",
                                     "usr/bin/env\\nusr/bin/env/x"])
def test_a_busybox_listing_that_escapes_is_one_line(envbuild_cli, tmp_path, printed):
    """Applet paths come from the binary: a link is never made outside the rootfs."""
    printed = printed.format(up="../" * 40, tmp=str(tmp_path).lstrip("/") if "{up}" in printed
                             else tmp_path)
    binary, _marker = _fake_busybox(tmp_path, printed + "\\n")
    _base(tmp_path, f"{{busybox: {{binary: {binary}}}}}")
    result = envbuild_cli("build", "evil")
    assert result.code == 1 and "Traceback" not in result.err, result.err
    assert "busybox" in result.err and "hint: the binary must be a genuine static busybox" in \
        result.err, result.err
    assert not os.path.lexists(tmp_path / "escaped") and not _published(envbuild_cli)
