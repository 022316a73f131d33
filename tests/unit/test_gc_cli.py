"""``envbuild gc``: dry run, --json, --grace, --job keeps what a resolved manifest pins."""

from __future__ import annotations

import json
import os

from envbuild.cli.main import main
from envbuild.jobs import parse_job_manifest, render_job_manifest, resolve_job_manifest
from envbuild.store import LocalStore, put_bytes, read_bytes
from tests.unit.test_gc_property import OLD
from tests.unit.test_jobs_support import make_env

JOB = """\
apiVersion: envbuild/v1
kind: JobManifest
groups: [{lock: env/a}]
"""


def age(store: LocalStore) -> None:
    for dirpath, _dirs, files in os.walk(store.root / "blobs"):
        for f in files:
            os.utime(os.path.join(dirpath, f), (OLD, OLD))


def test_gc_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    store = LocalStore(tmp_path / "store")
    make_env(store, tmp_path, "a", [{"etc/a": b"a"}, {"etc/b": b"b"}])
    m = resolve_job_manifest(parse_job_manifest(JOB), store)
    (tmp_path / "job.yaml").write_text(render_job_manifest(m))
    garbage = put_bytes(store, b"garbage")
    age(store)
    young = put_bytes(store, b"young garbage")

    assert main(["gc", "--store", "store", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out == f"would delete blob {garbage} 7 bytes\n" and "would delete 1 blob" in err
    assert store.exists(garbage)

    store.delete_ref("env/a")  # only the job manifest keeps the env now
    assert main(["--store", "store", "gc", "--job", "job.yaml", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in doc["deleted"]] == [garbage] and doc["young"] == 1
    assert not store.exists(garbage) and store.exists(young)
    for d in m.blobs():
        read_bytes(store, d)

    assert main(["gc", "--store", "store", "--grace", "0", "--json"]) == 0
    deleted = {d["name"] for d in json.loads(capsys.readouterr().out)["deleted"]}
    assert deleted == set(m.blobs()) | {young}


def test_gc_cli_bad_grace(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["gc", "--store", "store", "--grace", "soon"]) == 1
    err = capsys.readouterr().err
    assert "error: not a duration: 'soon'" in err and "hint:" in err
