"""``envbuild job verify``: every missing or corrupt lock, config, layer and TOC, not just the
first; exit 1 if there is any."""

from __future__ import annotations

import json

import pytest

from envbuild.cli.main import main
from envbuild.jobs import parse_job_manifest, render_job_manifest, resolve_job_manifest, verify_job_manifest
from envbuild.store import LocalStore, MemoryStore, get_json, put_json
from tests.unit.test_jobs_support import make_env

THREE = """\
apiVersion: envbuild/v1
kind: JobManifest
groups:
  - {name: a, lock: env/a}
  - {name: b, lock: env/b}
  - {name: c, lock: env/c}
"""


def setup(store, tmp_path):
    for name in "abc":
        make_env(store, tmp_path, name, [{f"etc/{name}": name.encode()},
                                         {f"opt/{name}/big": name.encode() * 50000}])
    return resolve_job_manifest(parse_job_manifest(THREE), store)


def test_intact_store_verifies(tmp_path):
    store = MemoryStore()
    m = setup(store, tmp_path)
    report = verify_job_manifest(m, store)
    assert report.ok and report.checked == 3 * 4  # lock, config, 2 layers each
    assert "no problems" in report.summary()


def test_every_missing_and_corrupt_blob_is_reported(tmp_path):
    store = MemoryStore()
    m = setup(store, tmp_path)
    a, b, c = m.groups
    store.delete(a.pinned.layers[1].digest)                   # a: a layer is gone
    bad = b.pinned.layers[0].digest                           # b: a layer is corrupt
    store.blobs[bad] = store.blobs[bad][:-1] + b"\0"
    store.delete(c.pinned.config)                             # c: its config is gone
    report = verify_job_manifest(m, store)
    got = {(p.kind, p.name, p.status, p.groups) for p in report.problems}
    assert got == {("layer", a.pinned.layers[1].digest, "missing", ("a",)),
                   ("layer", bad, "corrupt", ("b",)),
                   ("config", c.pinned.config, "missing", ("c",))}
    assert not report.ok and "2 missing" in report.summary() and "1 corrupt" in report.summary()


def test_missing_lock_still_checks_the_pinned_closure_and_a_missing_ref(tmp_path):
    store = MemoryStore()
    m = setup(store, tmp_path)
    a = m.groups[0]
    store.delete(a.lock)
    store.delete(a.pinned.layers[0].digest)
    unresolved = parse_job_manifest(THREE.replace("env/c", "env/nope"))
    report = verify_job_manifest(m, store)
    assert {(p.kind, p.status) for p in report.problems} == {("lock", "missing"),
                                                              ("layer", "missing")}
    report = verify_job_manifest(unresolved, store)
    assert [(p.kind, p.name, p.status) for p in report.problems] == [
        ("lock", a.lock, "missing"),  # env/a still points at the deleted lock
        ("ref", "env/nope", "missing")]


def test_toc_digest_checked_against_the_lock_annotation(tmp_path):
    """A lock whose annotation names another TOC: the blob verifies, its TOC does not."""
    store = MemoryStore()
    make_env(store, tmp_path, "a", [{"etc/a": b"a"}])
    manifest = get_json(store, store.get_ref("env/a").digest)
    manifest["layers"][0]["annotations"]["org.envbuild.toc.digest"] = "sha256:" + "0" * 64
    store.put_ref("env/a", put_json(store, manifest).digest)
    m = parse_job_manifest(THREE.split("  - {name: b")[0])
    (p,) = verify_job_manifest(m, store).problems
    assert (p.kind, p.status) == ("toc", "corrupt") and "TOC digest mismatch" in p.detail


def test_pinned_closure_that_disagrees_with_the_lock_is_a_mismatch(tmp_path):
    store = MemoryStore()
    m = setup(store, tmp_path)
    text = render_job_manifest(m).replace(m.groups[0].pinned.config, m.groups[1].pinned.config)
    report = verify_job_manifest(parse_job_manifest(text), store)
    assert [(p.kind, p.status, p.groups) for p in report.problems] == [
        ("lock", "mismatch", ("a",))]


def test_cli_verify_exit_code_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    store = LocalStore(tmp_path / "store")
    m = setup(store, tmp_path)
    (tmp_path / "jobs.yaml").write_text(render_job_manifest(m))
    assert main(["job", "verify", "jobs.yaml", "--store", "store"]) == 0
    assert "no problems" in capsys.readouterr().err
    store.blob_path(m.groups[0].pinned.layers[0].digest).write_bytes(b"junk")
    store.delete(m.groups[1].pinned.layers[1].digest)
    assert main(["job", "verify", "jobs.yaml", "--store", "store"]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and "corrupt layer" in out and "missing layer" in out
    assert main(["--store", "store", "job", "verify", "jobs.yaml", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and len(doc["problems"]) == 2


@pytest.mark.parametrize("jobs", [1, 8])
def test_parallelism_does_not_change_the_report(tmp_path, jobs):
    store = MemoryStore()
    m = setup(store, tmp_path)
    store.delete(m.groups[2].pinned.layers[0].digest)
    assert len(verify_job_manifest(m, store, jobs=jobs).problems) == 1
