"""The build host against hostile definitions, images and tarballs (issue 11, items 1, 2, 8,
11, 13, 14 and the sparse part of 9), each through the real CLI or the real importer.

Every attack asserts the secure outcome: nothing is written or removed outside the build, the
CLI prints one line (no traceback) and exits 1, nothing is published.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.store import LocalStore
from tests.conftest import require_tool

HEX40 = "0123456789abcdef0123456789abcdef01234567"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _one_line_error(result) -> None:
    assert result.code == 1, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "this is a bug" not in result.err, result.err
    assert result.err.strip(), "no error message"


def _published(cli) -> set[str]:
    """Key records in the CLI's store (what a build published)."""
    keys = Path(cli.store) / "keys"
    return {p.name for p in keys.rglob("*") if p.is_file()} if keys.exists() else set()


# ----------------------------------------------------------------------------- item 1: git


@pytest.mark.parametrize("command", ["validate", "build"])
def test_git_url_is_never_an_option_of_git(envbuild_cli, tmp_path, monkeypatch, command):
    """The issue's exact attack: ``--upload-pack=...`` as url and a 40-hex rev (which skips
    ``ls-remote``); before the fix ``envbuild build`` ran the command as root."""
    require_tool("git")
    marker = tmp_path / "pwned"
    monkeypatch.setenv("X", str(marker))
    _write(tmp_path / "envdefs" / "workspaces" / "evil.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: evil
        build_on: busybox-tiny
        source: {{git: {{url: "--upload-pack=touch $X;exit 1 #@x:y", rev: {HEX40}}}}}
        dest: /src
        """)
    before = _published(envbuild_cli)
    result = envbuild_cli(command, *(["evil"] if command == "build" else []))
    assert not marker.exists(), "git ran the url as --upload-pack"
    _one_line_error(result)
    assert "evil.yaml" in result.err and "git url" in result.err, result.err
    assert _published(envbuild_cli) == before


@pytest.mark.parametrize("url,rev", [
    ("ext::sh -c touch% /tmp/x", "main"),
    ("fd::17", "main"),
    ("https://example.invalid/r.git", "--output=/tmp/x"),
])
def test_git_transports_and_option_revs_are_refused(envbuild_cli, tmp_path, url, rev):
    require_tool("git")
    _write(tmp_path / "envdefs" / "workspaces" / "evil.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: evil
        build_on: busybox-tiny
        source: {{git: {{url: "{url}", rev: "{rev}"}}}}
        dest: /src
        """)
    result = envbuild_cli("validate")
    _one_line_error(result)
    assert "evil.yaml:5" in result.err, result.err


def test_git_itself_refuses_ext_transport(tmp_path):
    """Depth below the allow-list: ``git_env`` makes git refuse ``ext::`` even when called
    with it (a future code path that forgets the check)."""
    require_tool("git")
    from envbuild.build.pin import git_env

    marker = tmp_path / "ran"
    done = subprocess.run(["git", "ls-remote", f"ext::sh -c touch% {marker}"],
                          env=git_env(), capture_output=True, text=True)
    assert done.returncode != 0
    assert not marker.exists()


# ----------------------------------------------------------------------------- item 2: OCI


def _tar_bytes(members, compress: str = "") -> bytes:
    """members: (name, kind, extra): file (bytes), dir, symlink (target), char/block (maj, min)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compress}" if compress else "w",
                      format=tarfile.PAX_FORMAT) as tar:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            if kind == "file":
                info.size = len(extra)
                tar.addfile(info, io.BytesIO(extra))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                         "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE}[kind]
            if kind == "symlink":
                info.linkname = extra
            elif kind in ("char", "block"):
                info.devmajor, info.devminor = extra
                info.mode = 0o666
            else:
                info.mode = 0o755
            tar.addfile(info)
    return buf.getvalue()


def _oci_layout(root: Path, layers: list[bytes]) -> None:
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest

    diff_ids = [put(layer) for layer in layers]
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
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


def _oci_base(tmp_path: Path, layers: list[bytes], name: str = "evil") -> None:
    _oci_layout(tmp_path / "envdefs" / "base" / "img", layers)
    _write(tmp_path / "envdefs" / "base" / f"{name}.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Base
        name: {name}
        abi: oci-{name}
        from: {{oci: {{layout: img, ref: v1}}}}
        """)


def test_oci_layers_never_write_or_delete_through_a_planted_symlink(envbuild_cli, tmp_path):
    """The issue's image: layer 1 ``a -> /host/dir``, layer 2 ``a/OUT`` and ``a/.wh.victim``.
    Before the fix the build succeeded, OUT landed in the host dir and victim was deleted."""
    host = tmp_path / "hostdir"
    host.mkdir()
    (host / "victim").write_text("precious\n")
    _oci_base(tmp_path, [_tar_bytes([("a", "symlink", str(host))]),
                         _tar_bytes([("a/OUT", "file", b"pwned\n"),
                                     ("a/.wh.victim", "file", b"")])])
    before = _published(envbuild_cli)
    result = envbuild_cli("build", "evil")
    assert sorted(os.listdir(host)) == ["victim"], "the importer wrote into the host dir"
    assert (host / "victim").read_text() == "precious\n"
    _one_line_error(result)
    assert "through the symlink 'a'" in result.err, result.err
    assert _published(envbuild_cli) == before


# ----------------------------------------------------------------------------- item 11: devices


@pytest.mark.parametrize("source", ["rootfs", "oci"])
def test_device_nodes_in_a_rootfs_tarball_or_oci_base_are_refused(envbuild_cli, tmp_path,
                                                                  source):
    members = [("dev/", "dir", None), ("dev/sda", "block", (8, 0)),
               ("dev/mem", "char", (1, 1)), ("etc/", "dir", None), ("etc/motd", "file", b"hi")]
    if source == "rootfs":
        blob = _tar_bytes(members, "gz")
        (tmp_path / "envdefs" / "base" / "root.tar.gz").write_bytes(blob)
        _write(tmp_path / "envdefs" / "base" / "evil.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Base
            name: evil
            abi: dev-test
            from: {{rootfs: {{path: root.tar.gz, sha256: "{hashlib.sha256(blob).hexdigest()}"}}}}
            """)
    else:
        _oci_base(tmp_path, [_tar_bytes(members)])
    before = _published(envbuild_cli)
    result = envbuild_cli("build", "evil")
    _one_line_error(result)
    assert "device node, refused" in result.err, result.err
    assert _published(envbuild_cli) == before
    node = Path(envbuild_cli.node) / "node"
    devices = [p for p in node.rglob("*") if p.is_block_device() or p.is_char_device()
               and os.stat(p, follow_symlinks=False).st_rdev != 0] if node.exists() else []
    assert devices == []


def test_node_cache_refuses_device_layers_and_is_private(tmp_path):
    """A layer that carries a device node (built by a step that ran mknod, or crafted) never
    lands in the node cache; the cache's dirs are 0700."""
    from envbuild.errors import UnsafeLayerError
    from envbuild.layers import pack_tree
    from envbuild.store import put_file
    from runtime_shim.node.nodecache import NodeCache

    tree = tmp_path / "tree"
    (tree / "dev").mkdir(parents=True)
    os.mknod(tree / "dev" / "sda", stat_block(), os.makedev(8, 0))
    blob = tmp_path / "layer.tar.zst"
    with open(blob, "wb") as out:
        pack_tree(tree, out)
    store = LocalStore(tmp_path / "store")
    stored = put_file(store, blob)
    cache = NodeCache(tmp_path / "node")
    with pytest.raises(UnsafeLayerError, match="block node, refused"):
        cache.ensure(store, stored.digest)
    assert not cache.has(stored.digest)
    for d in (cache.root, cache.root / "layers", cache.root / "tmp", cache.root / "locks"):
        assert os.stat(d).st_mode & 0o777 == 0o700, d


def stat_block() -> int:
    import stat

    return stat.S_IFBLK | 0o666


# ----------------------------------------------------------------------------- item 8: copy/path


@pytest.mark.parametrize("how", ["dotdot", "symlink", "absolute-path-source", "symlink-in-dir"])
def test_copy_and_path_sources_stay_inside_the_repository(envbuild_cli, tmp_path, how):
    secret = tmp_path.parent / f"{tmp_path.name}-outside" / "shadow"
    secret.parent.mkdir(exist_ok=True)
    secret.write_text("root:$6$secret\n")
    files = tmp_path / "envdefs" / "base" / "files"
    files.mkdir(parents=True, exist_ok=True)
    up = os.path.relpath(secret, files.parent)
    if how == "dotdot":
        step = f"  - copy: {{src: {up}, dest: /etc/stolen}}"
        source = None
    elif how == "symlink":
        os.symlink(secret, files / "innocent")
        step = "  - copy: {src: files/innocent, dest: /etc/stolen}"
        source = None
    elif how == "symlink-in-dir":
        (files / "tree").mkdir()
        os.symlink(secret, files / "tree" / "link")
        step = "  - copy: {src: files/tree, dest: /etc/tree}"
        source = None
    else:
        step = None
        source = str(secret.parent)
    if source is None:
        _write(tmp_path / "envdefs" / "base" / "evil.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Base
            name: evil
            abi: copy-test
            from: {{scratch: {{}}}}
            steps:
            {step}
            """)
    else:
        _write(tmp_path / "envdefs" / "workspaces" / "evil.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Workspace
            name: evil
            build_on: busybox-tiny
            source: {{path: {source}}}
            dest: /src
            """)
    before = _published(envbuild_cli)
    result = envbuild_cli("build", "evil")
    if how == "symlink-in-dir":
        # a symlink inside a copied tree is copied as a link, never followed out
        assert result.code == 0, result.err
        from envbuild.layers import LayerReader
        from envbuild.store import get_key_record

        store = LocalStore(envbuild_cli.store)
        key = next(lay["key"] for lay in envbuild_cli("plan", "--json").json()["layers"]
                   if lay["name"] == "evil")
        with LayerReader.open_file(store.blob_path(get_key_record(store, key).layer)) as r:
            entry = r.stat("etc/tree/link")
            assert entry.type == "symlink" and entry.linkname == str(secret)
            assert not any(e.type == "file" and r.read(e.path) == secret.read_bytes()
                           for e in r.entries())
        return
    _one_line_error(result)
    assert "evil.yaml:" in result.err and "outside the source root" in result.err, result.err
    assert _published(envbuild_cli) == before


# ----------------------------------------------------------------------------- item 14: scratch


@pytest.mark.parametrize("cleaner", ["build", "node-gc"])
def test_a_sigkilled_build_leaves_no_scratch_dir_after_the_next_build(tmp_path, cleaner):
    """SIGKILL a real ``envbuild build`` while a step runs (the overlay mounted, runc running);
    the next build (or ``envbuild node gc``) removes its scratch dir, container and mount."""
    require_tool("runc")
    require_tool("busybox")
    defs = tmp_path / "envdefs"
    _write(defs / "base" / "bb.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: bb
        abi: bb-kill
        from: {busybox: {binary: /bin/busybox}}
        steps:
          - run: mkdir -p /tmp && touch /tmp/started && dd if=/dev/zero of=/big bs=1M count=20 && sleep 60
            network: none
        """)
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(tmp_path / "node"),
           "ENVBUILD_STORE": str(tmp_path / "store"), "ENVBUILD_DEFS": str(defs)}
    builds = tmp_path / "node" / "builds"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "envbuild.cli", "build"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                # the layer's upper dir is on its capped disk (runtime_shim.isolation.scratchfs)
                if any((d / "disk" / "upper" / "big").exists() for d in builds.glob("*")
                       if d.is_dir()):
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the step never started")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        stale = [d for d in builds.iterdir() if d.is_dir()]
        assert stale, "the killed build left nothing: the attack did not happen"
        # the next build: a different, quick definition tree on the same node dir
        _write(defs / "base" / "bb.yaml", """\
            apiVersion: envbuild/v1
            kind: Base
            name: bb
            abi: bb-kill
            from: {busybox: {binary: /bin/busybox}}
            """)
        command = ["build"] if cleaner == "build" else ["node", "gc"]
        done = subprocess.run([sys.executable, "-m", "envbuild.cli", *command], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert [d for d in builds.iterdir()] == [], list(builds.iterdir())
        with open("/proc/self/mountinfo") as f:
            assert not [ln for ln in f if str(builds) in ln]
        from runtime_shim.isolation.runc import OciRuntime, list_containers

        assert list_containers(OciRuntime(state_root=str(tmp_path / "node" / "runc")),
                               "eb-build-") == []
    finally:  # whatever failed above, the killed build's containers and mounts go
        _clean_killed_build(tmp_path / "node")


def _clean_killed_build(node) -> None:
    from envbuild.build.executor import sweep_stale_scratch
    from runtime_shim.isolation.mount import mounted_targets_under, unmount
    from runtime_shim.isolation.runc import OciRuntime

    sweep_stale_scratch(node / "builds", OciRuntime(state_root=str(node / "runc")))
    for target in mounted_targets_under(str(node)):
        unmount(target)


# ----------------------------------------------------------------------------- item 9: sparse


def test_a_sparse_snapshot_restores_sparse_in_the_node_cache(tmp_path):
    """The issue's bomb: a 1000 MiB sparse file packs into a few KB; restoring it through the
    node cache (what a sandbox resumed from the snapshot does) used to cost 1000 MiB of disk."""
    from envbuild.layers import pack_tree
    from envbuild.store import put_file
    from runtime_shim.node.nodecache import NodeCache

    tree = tmp_path / "tree"
    tree.mkdir()
    with open(tree / "sparse", "wb") as f:
        f.truncate(1000 << 20)
        f.seek(500 << 20)
        f.write(b"x")
    blob = tmp_path / "layer.tar.zst"
    with open(blob, "wb") as out:
        pack_tree(tree, out)
    assert blob.stat().st_size < 1 << 20
    store = LocalStore(tmp_path / "store")
    digest = put_file(store, blob).digest
    restored = NodeCache(tmp_path / "node").ensure(store, digest) / "sparse"
    st = os.stat(restored)
    assert st.st_size == 1000 << 20
    assert st.st_blocks * 512 <= 1 << 20, f"{st.st_blocks * 512} bytes on disk"
