"""Each source importer through a real build: rootfs (dir, tarball), scratch, oci, git, archive,
and debootstrap (the real thing, ~30 s)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest

from envbuild.build.importers import default_debian_mirror
from envbuild.layers import LayerReader
from envbuild.store import LocalStore, get_key_record
from tests.conftest import REPO, require_tool


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _layer_files(cli, name: str, key: str | None = None) -> dict[str, bytes | None]:
    """{path: content (None for non-files)} of the layer built for ``name``."""
    store = LocalStore(cli.store)
    if key is None:
        plan = cli("plan", "--json").json()
        key = next(lay["key"] for lay in plan["layers"] if lay["name"] == name)
    record = get_key_record(store, key)
    assert record is not None, f"{name} was not built"
    with LayerReader.open_file(store.blob_path(record.layer)) as r:
        return {e.path: (r.read(e.path) if e.type == "file" else None) for e in r.entries()}


def _build_ok(cli, *names):
    result = cli("build", *names, "--json")
    assert result.code == 0, result.err
    return result.json()


def _tar_bytes(members: list[tuple[str, bytes | None]], compress: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compress}" if compress else "w",
                      format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_rootfs_directory_and_tarball_with_enforced_sha256(envbuild_cli, tmp_path):
    tree = tmp_path / "envdefs" / "base" / "tree"
    _write(tree / "etc" / "motd", "from a directory\n")
    blob = _tar_bytes([("etc/", None), ("etc/motd", b"from a tarball\n")], "gz")
    (tmp_path / "envdefs" / "base" / "root.tar.gz").write_bytes(blob)
    sha = hashlib.sha256(blob).hexdigest()
    _write(tmp_path / "envdefs" / "base" / "fromdir.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: fromdir
        abi: test-a
        from: {rootfs: tree}
        """)
    _write(tmp_path / "envdefs" / "base" / "fromtar.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Base
        name: fromtar
        abi: test-b
        from: {{rootfs: {{path: root.tar.gz, sha256: {sha}}}}}
        """)
    _build_ok(envbuild_cli, "fromdir", "fromtar")
    assert _layer_files(envbuild_cli, "fromdir")["etc/motd"] == b"from a directory\n"
    assert _layer_files(envbuild_cli, "fromtar")["etc/motd"] == b"from a tarball\n"

    wrong = "0" * 64
    _write(tmp_path / "envdefs" / "base" / "fromtar.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Base
        name: fromtar
        abi: test-b
        from: {{rootfs: {{path: root.tar.gz, sha256: {wrong}}}}}
        """)
    result = envbuild_cli("build", "fromtar")
    assert result.code == 1
    assert "sha256" in result.err and "Traceback" not in result.err


def test_scratch_base_with_copy_steps(envbuild_cli, tmp_path):
    _write(tmp_path / "envdefs" / "base" / "files" / "hello.sh", "#!/bin/sh\necho hi\n")
    _write(tmp_path / "envdefs" / "base" / "scratchy.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: scratchy
        abi: scratch-test
        from: {scratch: {}}
        steps:
          - copy: {src: files/hello.sh, dest: /usr/local/bin/hello, mode: "0750", owner: "1000:1000"}
        """)
    _build_ok(envbuild_cli, "scratchy")
    store = LocalStore(envbuild_cli.store)
    key = next(lay["key"] for lay in envbuild_cli("plan", "--json").json()["layers"]
               if lay["name"] == "scratchy")
    with LayerReader.open_file(store.blob_path(get_key_record(store, key).layer)) as r:
        entry = r.stat("usr/local/bin/hello")
        assert (entry.mode & 0o7777, entry.uid, entry.gid) == (0o750, 1000, 1000)
        assert r.read("usr/local/bin/hello") == b"#!/bin/sh\necho hi\n"
        # the stub layer's mount points never leak into a layer
        assert not any(e.path.startswith(("proc", "sys", ".envbuild")) for e in r.entries())


def _oci_layout(root: Path, layers: list[bytes], config: dict) -> None:
    """A hand-made OCI image layout with uncompressed tar layers."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest

    diff_ids = [put(layer) for layer in layers]
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                      "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": put(cfg), "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                    "size": len(layer)} for d, layer in zip(diff_ids, layers)]}).encode()
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest),
         "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))


def test_oci_image_layers_with_whiteouts_and_config(envbuild_cli, tmp_path):
    lower = _tar_bytes([("a/", None), ("a/x", b"x"), ("a/y", b"y"), ("d/", None),
                        ("d/old", b"old"), ("keep", b"keep")])
    upper = _tar_bytes([("a/", None), ("a/.wh.x", b""), ("d/", None), ("d/.wh..wh..opq", b""),
                        ("d/new", b"new")])
    _oci_layout(tmp_path / "envdefs" / "base" / "img", [lower, upper],
                {"Env": ["PATH=/usr/bin:/bin", "FROM_IMAGE=yes"], "WorkingDir": "/srv",
                 "User": "1000:1000"})
    _write(tmp_path / "envdefs" / "base" / "fromoci.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: fromoci
        abi: oci-test
        from: {oci: {layout: img, ref: v1}}
        """)
    _write(tmp_path / "envdefs" / "envs" / "ocienv.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: ocienv
        base: fromoci
        """)
    report = _build_ok(envbuild_cli, "ocienv")
    files = _layer_files(envbuild_cli, "fromoci")
    assert files["a/y"] == b"y" and files["keep"] == b"keep" and files["d/new"] == b"new"
    assert "a/x" not in files and "d/old" not in files
    assert not any(".wh." in p for p in files)  # whiteouts applied, not carried
    store = LocalStore(envbuild_cli.store)
    manifest = json.loads(store.blob_path(report["locks"][0]["digest"]).read_bytes())
    config = json.loads(store.blob_path(manifest["config"]["digest"]).read_bytes())["config"]
    assert "FROM_IMAGE=yes" in config["Env"]
    assert config["WorkingDir"] == "/srv" and config["User"] == "1000:1000"


def test_oci_ref_missing_is_a_clear_error(envbuild_cli, tmp_path):
    _oci_layout(tmp_path / "envdefs" / "base" / "img", [_tar_bytes([("f", b"1")])], {})
    _write(tmp_path / "envdefs" / "base" / "fromoci.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: fromoci
        abi: oci-test
        from: {oci: {layout: img, ref: nope}}
        """)
    result = envbuild_cli("build", "fromoci")
    assert result.code == 1
    assert "nope" in result.err and "v1" in result.err and "Traceback" not in result.err


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                          "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                                          "PATH": "/usr/bin:/bin"}).stdout.strip()


@pytest.mark.parametrize("url_form", ["relative", "file"])
def test_git_workspace_pins_a_branch_to_its_commit(envbuild_cli, tmp_path, url_form):
    require_tool("git")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "lib.sh").write_text("v1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    first = _git(repo, "rev-parse", "HEAD")
    url = "../../repo" if url_form == "relative" else repo.as_uri()
    _write(tmp_path / "envdefs" / "workspaces" / "gitws.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: gitws
        build_on: busybox-tiny
        source: {{git: {{url: "{url}", rev: main}}}}
        dest: /src
        """)
    _build_ok(envbuild_cli, "gitws")
    assert _layer_files(envbuild_cli, "gitws")["src/lib.sh"] == b"v1\n"
    explain = envbuild_cli("explain", "gitws")
    assert first in explain.out

    (repo / "lib.sh").write_text("v2\n")
    _git(repo, "commit", "-q", "-am", "two")
    report = _build_ok(envbuild_cli, "gitws")
    assert {lay["name"]: lay["status"] for lay in report["layers"]}["gitws"] == "built"
    files = _layer_files(envbuild_cli, "gitws")
    assert files["src/lib.sh"] == b"v2\n"
    assert not any(p.startswith("src/.git") for p in files)


def test_archive_workspace_with_sha256(envbuild_cli, tmp_path):
    blob = _tar_bytes([("pkg/", None), ("pkg/README", b"archived\n")], "gz")
    (tmp_path / "envdefs" / "workspaces" / "src.tar.gz").write_bytes(blob)
    _write(tmp_path / "envdefs" / "workspaces" / "arch.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: arch
        build_on: busybox-tiny
        source: {{archive: {{path: src.tar.gz, sha256: {hashlib.sha256(blob).hexdigest()}}}}}
        dest: /workspace
        check: ["test -f /workspace/pkg/README"]
        """)
    _build_ok(envbuild_cli, "arch")
    assert _layer_files(envbuild_cli, "arch")["workspace/pkg/README"] == b"archived\n"


def test_default_mirror_comes_from_apt_sources(tmp_path):
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://mirror.example/debian bookworm main\n")
    assert default_debian_mirror([str(tmp_path / "sources.list")]) == "http://mirror.example/debian"
    d = tmp_path / "d"
    d.mkdir()
    (d / "debian.sources").write_text("Types: deb\nURIs: http://deb.example/debian\nSuites: bookworm\n")
    assert default_debian_mirror([str(d)]) == "http://deb.example/debian"
    assert default_debian_mirror([str(tmp_path / "none")]) == "http://deb.debian.org/debian"


def test_debootstrap_base_and_a_toolkit_on_it(envbuild_cli, tmp_path):
    """The real Debian path of the main job: debootstrap bookworm minbase, the ripgrep toolkit
    (apt download over the network), the shtest toolkit from busybox, and a command in the env."""
    require_tool("debootstrap")
    for rel in ("envdefs/base/debian-bookworm.yaml", "envdefs/base/files/debian",
                "envdefs/toolkits/ripgrep.yaml", "envdefs/envs/debian-tools.yaml"):
        src, target = REPO / rel, tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            import shutil

            shutil.copytree(src, target)
        else:
            target.write_bytes(src.read_bytes())
    _build_ok(envbuild_cli, "debian-tools")
    files = _layer_files(envbuild_cli, "debian-bookworm")
    assert files["etc/debian_version"].startswith(b"12.")
    assert files.get("etc/resolv.conf", b"") == b""  # no host DNS config in the layer
    result = envbuild_cli("run", "debian-tools", "--", "sh", "-c",
                          "rg --version | head -1; shtest --help >/dev/null; echo ok")
    assert result.code == 0, result.err
    assert "ripgrep" in result.out and "ok" in result.out


def test_a_cancelled_import_kills_its_tool_at_once():
    import threading
    import time

    from envbuild.build.importers import run_tool
    from envbuild.errors import BuildError

    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(BuildError, match="cancelled"):
        run_tool(["sh", "-c", "sleep 30 & sleep 30"], "slow import", cancelled=cancelled)
    assert time.monotonic() - started < 3
    ps = subprocess.run(["pgrep", "-f", "sleep 30 & sleep 30"], capture_output=True)
    assert ps.returncode == 1  # the whole process group is gone
