"""LocalStore only: the on-disk layout, opening, and several processes at once."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import subprocess
import tarfile

import pytest

from envbuild.errors import RefNotFound, StoreError, StoreUnavailable
from envbuild.store import (
    MEDIA_TYPE_CONFIG,
    LocalStore,
    RefConflict,
    digest_bytes,
    put_bytes,
    put_json,
    read_bytes,
)
from envbuild.store.base import REF_NAME_ANNOTATION
from tests.conftest import require_tool
from tests.oci_schemas import IMAGE_SPEC, assert_valid

# fork: children inherit the test's imports and closures; the store itself is reopened in each.
MP = multiprocessing.get_context("fork")


def _run_all(procs: list, timeout: float = 60) -> None:
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert [p.exitcode for p in procs] == [0] * len(procs)


# -- layout --------------------------------------------------------------------------------


def test_new_store_is_an_oci_layout_that_validates(tmp_path):
    root = tmp_path / "a" / "b" / "cache"  # missing parents are created
    store = LocalStore(root)
    assert json.loads((root / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    assert json.loads((root / "envbuild-store.json").read_text()) == {"version": 1}
    assert (root / "blobs" / "sha256").is_dir()
    assert_valid(IMAGE_SPEC, "image-layout-schema.json",
                 json.loads((root / "oci-layout").read_text()))
    assert_valid(IMAGE_SPEC, "image-index-schema.json", json.loads((root / "index.json").read_text()))

    desc = put_json(store, {"schemaVersion": 2})
    store.put_ref("envs/swe-requests", desc.digest, annotations={"org.example.k": "v"})
    store.put_ref("base:1", desc.digest)
    index = json.loads((root / "index.json").read_text())
    assert_valid(IMAGE_SPEC, "image-index-schema.json", index)
    assert [m["annotations"][REF_NAME_ANNOTATION] for m in index["manifests"]] == [
        "envs/swe-requests", "base:1"]
    assert (root / "blobs" / "sha256" / desc.digest.removeprefix("sha256:")).read_bytes() == \
        b'{"schemaVersion":2}'


def test_reopening_keeps_everything(tmp_path):
    d = put_bytes(LocalStore(tmp_path), b"x")
    LocalStore(tmp_path).put_ref("r", d)
    again = LocalStore(tmp_path)
    assert again.get_ref("r").digest == d
    assert read_bytes(again, d) == b"x"


def test_existing_oci_layout_from_another_tool_is_adopted_and_preserved(tmp_path):
    foreign = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
               "digest": "sha256:" + "1" * 64, "size": 3}
    named = {**foreign, "annotations": {REF_NAME_ANNOTATION: "theirs"}}
    (tmp_path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}\n')
    (tmp_path / "index.json").write_text(json.dumps(
        {"schemaVersion": 2, "manifests": [foreign, named], "annotations": {"x": "y"}}))
    store = LocalStore(tmp_path)
    assert store.list_refs() == ["theirs"]
    d = put_bytes(store, b"mine")
    store.put_ref("mine", d)
    store.put_ref("theirs", d)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["annotations"] == {"x": "y"}
    assert index["manifests"][0] == foreign  # untouched, in place
    assert [m.get("annotations", {}).get(REF_NAME_ANNOTATION) for m in index["manifests"]] == [
        None, "theirs", "mine"]
    store.delete_ref("theirs")
    assert json.loads((tmp_path / "index.json").read_text())["manifests"][0] == foreign


def test_temp_and_stray_files_are_not_listed(tmp_path):
    store = LocalStore(tmp_path)
    d = put_bytes(store, b"x")
    blobs = tmp_path / "blobs" / "sha256"
    (blobs / ".tmp-deadbeef").write_bytes(b"half a blob")
    (blobs / "README").write_text("not a blob")
    (tmp_path / "keys" / "v1").mkdir(parents=True)
    (tmp_path / "keys" / "v1" / ".tmp-0123").write_text("{}")
    assert list(store.list()) == [d]
    assert store.list_records("keys/v1") == []


def test_refused_put_leaves_no_temp_file(tmp_path):
    store = LocalStore(tmp_path)
    with pytest.raises(StoreError):
        store.put(digest_bytes(b"a"), b"b")
    assert os.listdir(tmp_path / "blobs" / "sha256") == []


def test_damaged_index_is_reported(tmp_path):
    store = LocalStore(tmp_path)
    (tmp_path / "index.json").write_text('{"manifests": [')
    with pytest.raises(StoreError, match="parse .*index.json") as e:
        store.get_ref("r")
    assert e.value.hint


def test_a_missing_index_has_no_refs(tmp_path):
    # the store reads a missing index.json as an empty one; the ref lookup took the empty
    # index document itself for its name -> entry map (found by mypy)
    store = LocalStore(tmp_path)
    (tmp_path / "index.json").unlink()
    for name in ("manifests", "schemaVersion", "r"):
        with pytest.raises(RefNotFound):
            store.get_ref(name)


# -- opening -------------------------------------------------------------------------------


def test_a_file_is_not_a_store(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(StoreUnavailable, match="not a directory") as e:
        LocalStore(tmp_path / "f")
    assert "--store" in e.value.hint
    with pytest.raises(StoreUnavailable, match="create store directory"):
        LocalStore(tmp_path / "f" / "below")


def test_unwritable_store_is_refused(tmp_path, monkeypatch):
    LocalStore(tmp_path)
    # root ignores permission bits, so simulate what access(2) reports to other users
    monkeypatch.setattr("envbuild.store.local.os.access", lambda *a, **k: False)
    with pytest.raises(StoreUnavailable, match="not writable") as e:
        LocalStore(tmp_path)
    assert "permissions" in e.value.hint


@pytest.mark.parametrize(("file", "content", "named"), [
    ("envbuild-store.json", '{"version": 2}', "unsupported envbuild store version 2"),
    ("envbuild-store.json", '{}', "unsupported envbuild store version None"),
    ("oci-layout", '{"imageLayoutVersion": "9.9.9"}', "unsupported OCI image layout version"),
    ("oci-layout", 'not json', "parse"),
])
def test_unknown_versions_are_refused_by_name(tmp_path, file, content, named):
    LocalStore(tmp_path)
    (tmp_path / file).write_text(content)
    with pytest.raises(StoreUnavailable, match=named) as e:
        LocalStore(tmp_path)
    assert e.value.hint


# -- several processes ---------------------------------------------------------------------


def test_processes_putting_the_same_blob_all_succeed(tmp_path):
    data = os.urandom(8 << 20)
    digest = digest_bytes(data)
    LocalStore(tmp_path)
    barrier = MP.Barrier(4)

    def put() -> None:
        store = LocalStore(tmp_path)
        barrier.wait()
        store.put(digest, io.BytesIO(data), size=len(data))
        assert read_bytes(store, digest) == data

    _run_all([MP.Process(target=put) for _ in range(4)])
    store = LocalStore(tmp_path)
    assert list(store.list()) == [digest]
    assert read_bytes(store, digest) == data
    assert os.listdir(tmp_path / "blobs" / "sha256") == [digest.removeprefix("sha256:")]


def test_concurrent_ref_updates_all_land_and_index_is_never_torn(tmp_path):
    workers, rounds = 4, 15
    store = LocalStore(tmp_path)
    counter = [put_bytes(store, str(i).encode()) for i in range(workers * rounds + 1)]
    value = {d: i for i, d in enumerate(counter)}
    store.put_ref("counter", counter[0])
    barrier = MP.Barrier(workers + 1)
    done = MP.Event()

    def increment(worker: int) -> None:
        s = LocalStore(tmp_path)
        barrier.wait()
        for r in range(rounds):
            while True:  # the CAS retry loop every caller of expect= writes
                current = s.get_ref("counter").digest
                try:
                    s.put_ref("counter", counter[value[current] + 1], expect=current)
                    break
                except RefConflict:
                    continue
            s.put_ref(f"w{worker}/r{r}", counter[0])  # unconditional updates must not be lost
            json.loads((tmp_path / "index.json").read_bytes())

    def read_index() -> None:
        barrier.wait()
        reads = 0
        while not done.is_set() or reads == 0:
            index = json.loads((tmp_path / "index.json").read_bytes())  # never torn
            assert isinstance(index["manifests"], list)
            reads += 1

    reader = MP.Process(target=read_index)
    reader.start()
    _run_all([MP.Process(target=increment, args=(w,)) for w in range(workers)])
    done.set()
    reader.join(30)
    assert reader.exitcode == 0

    assert value[store.get_ref("counter").digest] == workers * rounds
    assert store.list_refs() == sorted(
        ["counter"] + [f"w{w}/r{r}" for w in range(workers) for r in range(rounds)])
    assert_valid(IMAGE_SPEC, "image-index-schema.json",
                 json.loads((tmp_path / "index.json").read_text()))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_processes_creating_the_same_store_at_once(tmp_path):
    barrier = MP.Barrier(4)
    root = tmp_path / "new"

    def create() -> None:
        barrier.wait()
        LocalStore(root).put(digest_bytes(b"x"), b"x")

    _run_all([MP.Process(target=create) for _ in range(4)])
    assert json.loads((root / "envbuild-store.json").read_text()) == {"version": 1}
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "blobs", "envbuild-store.json", "index.json", "oci-layout"]


# -- other OCI tools read it ---------------------------------------------------------------


def _tiny_image(store: LocalStore, name: str) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size, info.mtime = 6, 0
        tar.addfile(info, io.BytesIO(b"hello\n"))
    layer = buf.getvalue()
    layer_digest = put_bytes(store, layer)
    config = put_json(store, {"architecture": "amd64", "os": "linux",
                              "rootfs": {"type": "layers", "diff_ids": [layer_digest]}},
                      media_type=MEDIA_TYPE_CONFIG)
    manifest = put_json(store, {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config.to_oci(),
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": len(layer)}]})
    store.put_ref(name, manifest.digest)
    return manifest.digest


@pytest.mark.integration
def test_skopeo_and_umoci_read_the_store(tmp_path):
    skopeo, umoci = require_tool("skopeo"), require_tool("umoci")
    store = LocalStore(tmp_path / "cache")
    manifest = _tiny_image(store, "envs/tiny")
    out = subprocess.run([skopeo, "inspect", "--raw", f"oci:{tmp_path / 'cache'}:envs/tiny"],
                         check=True, capture_output=True)
    assert digest_bytes(out.stdout) == manifest
    listed = subprocess.run([umoci, "ls", "--layout", str(tmp_path / "cache")],
                            check=True, capture_output=True, text=True)
    assert "envs/tiny" in listed.stdout.split()

    # and a layout written by skopeo opens as a store
    subprocess.run([skopeo, "copy", "--preserve-digests", f"oci:{tmp_path / 'cache'}:envs/tiny",
                    f"oci:{tmp_path / 'copy'}:tiny"], check=True, capture_output=True)
    copy = LocalStore(tmp_path / "copy")
    assert copy.get_ref("tiny").digest == manifest
    assert sorted(copy.list()) == sorted(store.list())


def _tree_state(root) -> dict[str, tuple[int, int]]:
    return {os.path.relpath(os.path.join(d, n), root): (os.lstat(os.path.join(d, n)).st_size,
                                                        os.lstat(os.path.join(d, n)).st_mtime_ns)
            for d, dirs, files in os.walk(root) for n in dirs + files}


@pytest.mark.integration
def test_read_only_commands_write_nothing_into_a_foreign_layout(tmp_path, monkeypatch, capsys):
    """Issue 12, item 9: ``--store`` someone else's OCI layout (here one skopeo wrote) for
    read-only commands leaves it byte for byte as it was: no envbuild-store.json, no keys/."""
    from envbuild.cli.main import main
    from envbuild.layers import pack_to_store
    from tests.conftest import REPO

    skopeo = require_tool("skopeo")
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "motd").write_text("hello\n")
    ours = LocalStore(tmp_path / "ours")
    info = pack_to_store(src, ours)
    config = put_json(ours, {"architecture": "amd64", "os": "linux",
                             "rootfs": {"type": "layers", "diff_ids": [info.diff_id]}},
                      media_type=MEDIA_TYPE_CONFIG)
    manifest = put_json(ours, {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config.to_oci(),
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
                    "digest": info.digest, "size": info.size}]})
    ours.put_ref("envs/motd", manifest.digest)
    foreign = tmp_path / "theirs"
    subprocess.run([skopeo, "copy", "--preserve-digests", f"oci:{tmp_path / 'ours'}:envs/motd",
                    f"oci:{foreign}:motd"], check=True, capture_output=True)
    assert not (foreign / "envbuild-store.json").exists()
    before = _tree_state(foreign)

    monkeypatch.setenv("ENVBUILD_STORE", str(foreign))
    monkeypatch.setenv("ENVBUILD_DEFS", str(REPO / "envdefs"))
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(tmp_path / "node"))
    for argv in (["layer", "ls", info.digest], ["layer", "cat", info.digest, "etc/motd"],
                 ["layer", "verify", info.digest], ["layer", "stat", info.digest],
                 ["plan", "busybox-shell"]):
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    assert "hello" in capsys.readouterr().out
    assert _tree_state(foreign) == before
    # and a store it opens is still an ordinary store for writes
    LocalStore(foreign).put(digest_bytes(b"x"), b"x")


def test_a_store_moved_away_is_never_made_anew(tmp_path):
    """A reader never creates a store (``create=False``), and an open store whose directory
    was moved away makes no empty one in its place when it writes a record, a conditional
    record (the soak moved the store away for two seconds: a lazy profile save re-created
    it, and moving the real one back failed)."""
    root = tmp_path / "store"
    with pytest.raises(StoreUnavailable, match="no store at"):
        LocalStore(root, create=False)
    assert not root.exists()
    store = LocalStore(root)
    root.rename(tmp_path / "away")
    with pytest.raises(StoreError):
        store.put_record("lazy-profiles", "p1", {"x": 1})
    with pytest.raises(StoreError):
        store.create_record("leases/v1", "k", {"x": 1})
    assert not root.exists()
