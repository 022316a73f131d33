"""``--json`` of the commands that need a real sandbox or node (``lock``, ``check``,
``sandbox ls|rm|gc``, ``node ls|gc``) and ``run --backend fncall``, on one build of the busybox
env. The documents' keys are the contract of ``docs/cli-json.md``: checked exactly."""

from __future__ import annotations

import re

import pytest

from tests.integration.conftest import Env, build_busybox_env

pytestmark = pytest.mark.integration

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-json")
    store, node = build_busybox_env(root)
    return root, store, node


@pytest.fixture
def cli(built, monkeypatch, capsys) -> Env:
    root, store, node = built
    return Env(store=store.root, node=node, defs=root / "envdefs", monkeypatch=monkeypatch,
               capsys=capsys)


def test_lock_and_check_json(cli, built):
    r = cli("lock", "--json", "busybox-shell")
    assert r.code == 0, r.err
    assert r.json() == {"locks": [{"env": "busybox-shell",
                                   "digest": built[1].get_ref("env/busybox-shell").digest}],
                        "tasks": []}
    r = cli("check", "--json", "busybox-shell")
    assert r.code == 0, r.err
    doc = r.json()
    assert set(doc) == {"results", "passed", "failed"}
    assert (doc["passed"], doc["failed"]) == (len(doc["results"]), 0) and doc["results"]
    for res in doc["results"]:
        assert set(res) == {"env", "workspace", "command", "ok", "exit_code", "timed_out",
                            "timeout", "seconds", "summary", "tail"}
        assert (res["env"], res["ok"], res["exit_code"]) == ("busybox-shell", True, 0)
    r = cli("check", "--json", "no-such-env")
    assert (r.code, r.out) == (1, "")
    assert r.err.splitlines() == ["error: no env named 'no-such-env'",
                                  "hint: envbuild graph lists the envs"]


def test_sandbox_and_node_json(cli):
    r = cli("run", "--keep", "busybox-shell", "true")
    assert r.code == 0, r.err
    sid = re.search(r"sandbox (eb-\S+) kept", r.err).group(1)
    try:
        _ls_and_rm(cli, sid)
    finally:  # a failed assertion leaves no kept sandbox (and its mounts) behind
        from runtime_shim.sdk.sandbox import list_sandboxes, remove_sandbox

        if any(s.id == sid for s in list_sandboxes(cli.node)):
            remove_sandbox(cli.node, sid)
    r = cli("sandbox", "gc", "--json")
    assert (r.code, r.json()) == (0, {"removed": [], "failed": []})
    layers = cli("node", "ls", "--json").json()["layers"]
    r = cli("node", "gc", "--json", "--max-size", "0")
    assert r.code == 0, r.err
    doc = r.json()
    assert set(doc) == {"evicted", "budget", "in_use", "scratch_removed", "objects"}
    assert doc["objects"] == {}  # no native object store on this node (docs/cli-json.md)
    assert sorted(doc["evicted"]) == sorted(u["digest"] for u in layers)
    assert (doc["budget"], doc["in_use"]) == (0, [])
    assert cli("node", "ls", "--json").json()["layers"] == []


def _ls_and_rm(cli, sid: str) -> None:
    doc = cli("sandbox", "ls", "--json").json()
    [mine] = [s for s in doc["sandboxes"] if s["id"] == sid]
    assert set(mine) == {"id", "backend", "state", "lock", "pid", "alive", "kept", "created",
                         "expires", "lazy", "runtime"}
    assert (mine["backend"], mine["state"], mine["kept"]) == ("container", "kept", True)
    assert DIGEST.fullmatch(mine["lock"])

    node = cli("node", "ls", "--json").json()
    assert set(node) == {"layers", "bytes", "native"}
    assert node["layers"] and node["bytes"] == sum(u["size"] for u in node["layers"])
    assert all(set(u) == {"digest", "size", "last_used"} and DIGEST.fullmatch(u["digest"])
               for u in node["layers"])

    r = cli("sandbox", "rm", "--json", sid, "eb-0123456789ab")
    assert r.code == 1
    doc = r.json()
    assert doc["removed"] == [sid]
    assert [f["id"] for f in doc["failed"]] == ["eb-0123456789ab"]
    assert "no sandbox eb-0123456789ab" in doc["failed"][0]["error"]
    assert cli("sandbox", "ls", "--json").json() == {"sandboxes": []}


def test_run_with_the_fncall_backend(cli):
    r = cli("run", "--backend", "fncall", "busybox-shell", "sh", "-c", "echo hi; echo err >&2")
    assert (r.code, r.out, r.err) == (0, "hi\n", "err\n")
    r = cli("run", "--backend", "fncall", "--keep", "busybox-shell", "true")
    assert r.code == 1 and "fncall sandboxes cannot be kept" in r.err
