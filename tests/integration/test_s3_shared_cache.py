"""Two machines share one bucket: A builds the busybox env with --cache-to, B (empty local store
and node cache, same host) builds it with --cache-from and builds nothing."""

from __future__ import annotations

from envbuild.store import LocalStore
from tests.integration.conftest import Env
from tests.store.s3server import moto_s3, s3_env  # noqa: F401


def test_machine_b_builds_nothing(envbuild_cli, s3_env, tmp_path, monkeypatch, capsys):
    bucket = s3_env.make_bucket()
    url = f"s3://{bucket}/team-cache"
    machine_a = envbuild_cli
    r = machine_a("--cache-to", url, "build", "busybox-shell", "--json")
    assert r.code == 0, r.err
    built = r.json()
    assert {o["status"] for o in built["layers"]} == {"built"}

    machine_b = Env(store=tmp_path / "b-store", node=tmp_path / "b-node", defs=machine_a.defs,
                    monkeypatch=monkeypatch, capsys=capsys)
    r = machine_b("--cache-from", url, "build", "busybox-shell", "--json")
    assert r.code == 0, r.err
    report = r.json()
    assert [o["status"] for o in report["layers"]] == ["cached"] * len(built["layers"])
    assert [o["digest"] for o in report["layers"]] == [o["digest"] for o in built["layers"]]
    assert report["locks"] == built["locks"]  # the same lock, byte for byte
    b = LocalStore(tmp_path / "b-store")
    assert all(b.exists(o["digest"]) for o in report["layers"])
    assert not (tmp_path / "b-node" / "builds").exists() or \
        not any((tmp_path / "b-node" / "builds").iterdir())

    # and B can pull the lock A pushed, by name, without building anything
    r = machine_b("pull", "busybox-shell", "--from", url)
    assert r.code == 0, r.err
    assert b.get_ref("env/busybox-shell").digest == built["locks"][0]["digest"]
