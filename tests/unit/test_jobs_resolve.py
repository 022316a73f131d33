"""``envbuild job resolve``: refs pinned to digests with their closure; a resolved manifest
resolves to itself, byte for byte; problems of every group reported together."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from envbuild.cli.main import main
from envbuild.errors import StoreError
from envbuild.jobs import (
    default_output,
    load_job_manifest,
    parse_job_manifest,
    render_job_manifest,
    resolve_job_manifest,
)
from envbuild.sizes import format_size
from envbuild.store import LocalStore, MemoryStore, get_json
from runtime_shim import Limits
from tests.unit.test_jobs_support import MANIFEST, make_env


@pytest.fixture
def store(tmp_path):
    store = MemoryStore()
    make_env(store, tmp_path, "alpha", [{"etc/a": b"a"}, {"opt/t/x": b"x" * 40000}])
    make_env(store, tmp_path, "beta", [{"etc/b": b"b"}])
    return store


def test_resolve_pins_refs_and_records_the_closure(store):
    m = resolve_job_manifest(parse_job_manifest(MANIFEST), store)
    assert m.resolved
    swe, tools = m.groups
    alpha = store.get_ref("env/alpha").digest
    manifest = get_json(store, alpha)
    assert swe.lock == alpha and swe.pinned.ref == "env/alpha"
    assert tools.pinned.ref == "env/beta"  # a bare env name, as push resolves it
    assert swe.pinned.config == manifest["config"]["digest"]
    assert [(p.digest, p.size, p.toc) for p in swe.pinned.layers] == [
        (d["digest"], d["size"], d["annotations"]["org.envbuild.toc.digest"])
        for d in manifest["layers"]]
    assert set(m.blobs()) >= {alpha, swe.pinned.config, *(p.digest for p in swe.pinned.layers)}
    # options survive, defaults (Limits()'s) are written out, but cpus: each node's share
    doc = yaml.safe_load(render_job_manifest(m))
    default = Limits()
    assert doc["groups"][0]["limits"] == {
        "pids": 64, "memory_bytes": "1GiB", "nofile": default.nofile,
        "output_bytes": format_size(default.output_bytes), "exec_timeout": default.exec_timeout,
        "disk_bytes": format_size(default.disk_bytes), "inodes": default.inodes,
        "cpu_class": default.cpu_class, "inotify": default.inotify}
    assert doc["groups"][1]["backend"] == "microvm" and doc["groups"][1]["count"] == 1


def test_resolved_manifest_resolves_to_itself(store, tmp_path):
    first = render_job_manifest(resolve_job_manifest(parse_job_manifest(MANIFEST), store))
    # the refs move on; the resolved manifest does not
    make_env(store, tmp_path, "alpha2", [{"etc/new": b"new"}], ref="env/alpha")
    again = resolve_job_manifest(parse_job_manifest(first), store)
    assert render_job_manifest(again) == first
    as_json = render_job_manifest(again, as_json=True)
    assert render_job_manifest(parse_job_manifest(as_json, "x.json")) == first


def test_edited_pinned_closure_is_refused(store):
    m = resolve_job_manifest(parse_job_manifest(MANIFEST), store)
    g = m.groups[0]
    edited = dataclasses.replace(g, pinned=dataclasses.replace(g.pinned,
                                                               layers=g.pinned.layers[:1]))
    with pytest.raises(StoreError) as e:
        resolve_job_manifest(dataclasses.replace(m, groups=(edited, m.groups[1])), store)
    assert "do not match lock" in e.value.context


def test_every_unresolvable_group_is_reported(store):
    text = MANIFEST.replace("env/alpha", "env/nope").replace("lock: beta", "lock: gone")
    with pytest.raises(StoreError) as e:
        resolve_job_manifest(parse_job_manifest(text), store)
    assert e.value.reference == "job-unresolvable" and "2 of 2" in e.value.message
    assert "group swe:" in e.value.context and "group tools:" in e.value.context


def test_missing_layer_fails_resolve(store):
    layer = get_json(store, store.get_ref("env/beta").digest)["layers"][0]["digest"]
    store.delete(layer)
    with pytest.raises(StoreError) as e:
        resolve_job_manifest(parse_job_manifest(MANIFEST), store)
    assert layer in e.value.context


def test_default_output():
    assert str(default_output("jobs.yaml")) == "jobs.resolved.yaml"
    assert str(default_output("d/jobs.json")) == "d/jobs.resolved.json"
    assert str(default_output("d/jobs.resolved.yml")) == "d/jobs.resolved.yml"
    assert str(default_output("jobs")) == "jobs.resolved.yaml"


def test_cli_resolve_writes_next_to_the_file_and_rewrites_in_place(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    local = LocalStore(tmp_path / "store")
    make_env(local, tmp_path, "alpha", [{"etc/a": b"a"}])
    make_env(local, tmp_path, "beta", [{"etc/b": b"b"}])
    (tmp_path / "jobs.yaml").write_text(MANIFEST)
    assert main(["--store", "store", "job", "resolve", "jobs.yaml"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "jobs.resolved.yaml: 2 group(s) pinned" in err
    text = (tmp_path / "jobs.resolved.yaml").read_text()
    assert load_job_manifest(tmp_path / "jobs.resolved.yaml").resolved
    assert main(["job", "resolve", "jobs.resolved.yaml", "--store", "store"]) == 0
    assert (tmp_path / "jobs.resolved.yaml").read_text() == text
    assert main(["job", "resolve", "jobs.yaml", "--store", "store", "-o", "-"]) == 0
    assert capsys.readouterr().out == text
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_cli_resolve_error_is_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs.yaml").write_text(MANIFEST)
    assert main(["--store", "store", "job", "resolve", "jobs.yaml"]) == 1
    err = capsys.readouterr().err
    assert "error: cannot resolve 2 of 2 group(s)" in err and "hint:" in err
    assert not (tmp_path / "jobs.resolved.yaml").exists()
