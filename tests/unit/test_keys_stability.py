"""Keys are canonical and stable: same inputs -> same key, whatever the dict order, checkout
path, mtimes or run; and exactly the inputs that change a layer's bytes change its key."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from types import MappingProxyType

import pytest

from envbuild.build.pin import Pinner, pin_inputs
from envbuild.defs.model import CONSTRUCTORS, DefinitionSet, Origin
from envbuild.errors import SourceError
from envbuild.plan.graph import build_graph
from envbuild.plan.keys import canonical_json, compute_keys, layer_key
from tests.unit.test_plan_support import base, defset, env, fake_pins, tk, ws


def keys_of(*docs):
    d = defset(*docs)
    return compute_keys(build_graph(d), fake_pins(d))


def test_canonical_json_is_sorted_compact_ascii():
    assert canonical_json({"b": 1, "a": ["é", None]}) == b'{"a":["\\u00e9",null],"b":1}'
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1})


def test_layer_key_is_versioned_sha256_of_canonical_inputs():
    inputs = {"kind": "Base", "steps": []}
    expected = hashlib.sha256(b"envbuild.layer.v1\0" + canonical_json(inputs)).hexdigest()
    assert layer_key(inputs) == "sha256:" + expected


def test_key_does_not_depend_on_mapping_order():
    a = keys_of(base("b", steps=[{"run": "x", "env": {"A": "1", "B": "2"}}]))
    b = keys_of({"steps": [{"env": {"B": "2", "A": "1"}, "run": "x"}], "from":
                 {"debootstrap": {"suite": "bookworm"}}, "abi": "deb12", "name": "b",
                 "kind": "Base"})
    assert a.layers == b.layers


def test_metadata_is_not_in_the_key():
    plain = keys_of(base("b"), ws("w", "b", check=["true"]), tk("t", "b"))
    other = keys_of(base("b", description="x", labels={"team": "a"}),
                    ws("w", "b", check=["python -c 'import x'"], description="y"),
                    tk("t", "b", config={"env": {"PATH": "/opt/toolkits/t/bin:$PATH"}}))
    assert plain.layers == other.layers


def test_name_is_not_in_the_key_identical_layers_share_it():
    ks = keys_of(base("b"), tk("t1", "b", "/opt/t"), tk("t2", "b", "/opt/t"))
    assert ks.layers["t1"] == ks.layers["t2"]
    assert "name" not in ks.inputs["t1"]


@pytest.mark.parametrize("change", [
    lambda: tk("t", "b", "/opt/other"),
    lambda: tk("t", "b", steps=[{"run": "make install"}]),
    lambda: tk("t", "b", steps=[{"run": "true", "network": "none"}]),
    lambda: tk("t", "b", framing="compact"),
    lambda: tk("t", "b", pin="digest"),
])
def test_inputs_that_change_the_bytes_change_the_key(change):
    before = keys_of(base("b"), tk("t", "b", steps=[{"run": "true"}]))
    after = keys_of(base("b"), change())
    assert before.layers["t"] != after.layers["t"]


def test_config_reaches_env_lock_inputs_not_layer_keys():
    a = keys_of(base("b"), tk("t", "b"), env("e", "b", toolkits=["t"]))
    b = keys_of(base("b"), tk("t", "b", config={"env": {"X": "1"}}), env("e", "b", toolkits=["t"]))
    assert a.layers == b.layers
    assert a.env_locks["e"] != b.env_locks["e"]
    c = keys_of(base("b"), tk("t", "b"), env("e", "b", toolkits=["t"], config={"workdir": "/w"}))
    assert a.env_locks["e"] != c.env_locks["e"]


def test_parent_key_reaches_child_base():
    a = keys_of(base("root"), base("child", src={"base": "root"}))
    b = keys_of(base("root", steps=[{"run": "x"}]), base("child", src={"base": "root"}))
    assert a.layers["child"] != b.layers["child"]
    assert b.inputs["child"]["parent"] == b.layers["root"]


# ---------------------------------------------------------------------- pinning real files


def make_tree(root):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 4000)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    os.symlink("pkg/__init__.py", root / "link")
    return root


def tree_digest(path):
    return Pinner().path(str(path), ".")


def test_tree_digest_is_independent_of_location_and_mtimes(tmp_path):
    a = make_tree(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b, symlinks=True)
    for p in b.rglob("*"):
        if not p.is_symlink():
            os.utime(p, (1, 1))
    assert tree_digest(a) == tree_digest(b) == tree_digest(a)


@pytest.mark.parametrize("mutate", [
    lambda r: (r / "pkg" / "__init__.py").write_text("x = 2\n"),
    lambda r: (r / "run.sh").chmod(0o644),
    lambda r: (r / "empty" / "new").write_text(""),
    lambda r: (r / "empty").rmdir(),
    lambda r: (r / "link").unlink() or os.symlink("run.sh", r / "link"),
    lambda r: (r / "pkg" / "sub").rename(r / "pkg" / "sub2"),
    lambda r: (r / ".hidden").write_text(""),
])
def test_tree_digest_sees_every_change(tmp_path, mutate):
    root = make_tree(tmp_path / "t")
    before = tree_digest(root)
    mutate(root)
    assert tree_digest(root) != before


def test_tree_digest_ignores_vcs_and_bytecode(tmp_path):
    root = make_tree(tmp_path / "t")
    before = tree_digest(root)
    (root / ".git" / "objects").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "pkg" / "stale.pyc").write_bytes(b"\0")
    assert tree_digest(root) == before


def test_pins_are_computed_once_per_run(tmp_path, monkeypatch):
    make_tree(tmp_path / "src")
    p = Pinner()
    calls = []
    real = p.tree
    monkeypatch.setattr(p, "tree", lambda path: calls.append(path) or real(path))
    p.path(str(tmp_path), "src")
    p.path(str(tmp_path / "src" / "pkg"), "..")  # another spelling of the same directory
    p.path(str(tmp_path), "src")
    assert len(calls) == 1


def write_defs(root, docs):
    """Definitions whose origin is a file under ``root`` (relative sources resolve there)."""
    by_name = {}
    for m in docs:
        kind = m["kind"]
        path = root / "envdefs" / f"{m['name']}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        by_name[m["name"]] = CONSTRUCTORS[kind](m, Origin(file=str(path), line=2, column=1))
    return DefinitionSet(root=str(root / "envdefs"), by_name=MappingProxyType(by_name))


def real_keys(root, create=True):
    if create:
        make_tree(root / "sources" / "proj")
        (root / "envdefs" / "files").mkdir(parents=True)
        (root / "envdefs" / "files" / "motd").write_text("hello\n")
    defs = write_defs(root, [
        base("b", steps=[{"copy": {"src": "files/motd", "dest": "/etc/motd"}}]),
        ws("w", "b", path="../sources/proj", steps=[{"run": "pip install -e /workspace"}]),
        tk("t", "b", steps=[{"copy": {"src": "files", "dest": "/opt/toolkits/t/share"}}]),
        env("e", "b", "w", ["t"]),
    ])
    return compute_keys(build_graph(defs), pin_inputs(defs))


def test_keys_are_the_same_for_a_checkout_elsewhere_and_on_every_run(tmp_path):
    first = real_keys(tmp_path / "one")
    again = real_keys(tmp_path / "one", create=False)
    elsewhere = real_keys(tmp_path / "deeper" / "two")
    assert first.layers == again.layers == elsewhere.layers
    assert first.env_locks == elsewhere.env_locks
    # and nothing path-like leaks into the inputs
    assert str(tmp_path) not in json.dumps(dict(first.inputs))


def test_missing_path_is_a_source_error_at_the_definition_line(tmp_path):
    defs = write_defs(tmp_path, [base("b"), ws("w", "b", path="../nope")])
    with pytest.raises(SourceError) as info:
        pin_inputs(defs)
    assert f"{tmp_path}/envdefs/w.yaml:2:1" in info.value.message
    assert "nope" in info.value.message and info.value.hint


def test_all_pin_failures_are_reported_together(tmp_path):
    defs = write_defs(tmp_path, [base("b"), ws("w1", "b", path="x"), ws("w2", "b", path="y")])
    with pytest.raises(SourceError) as info:
        pin_inputs(defs)
    assert "2 sources" in info.value.message
    assert "w1" in info.value.context and "w2" in info.value.context


def test_archive_and_rootfs_tarball_sha256_are_checked(tmp_path):
    (tmp_path / "envdefs").mkdir()
    (tmp_path / "envdefs" / "a.tar").write_bytes(b"tar bytes")
    good = hashlib.sha256(b"tar bytes").hexdigest()
    ok = write_defs(tmp_path, [base("b", src={"rootfs": {"path": "a.tar", "sha256": good}}),
                               ws("w", "b", source={"archive": {"path": "a.tar", "sha256": good}})])
    pins = pin_inputs(ok)
    assert pins["b"]["source"] == pins["w"]["source"] == "sha256:" + good
    bad = write_defs(tmp_path, [base("b"),
                                ws("w", "b", source={"archive": {"path": "a.tar",
                                                                 "sha256": "0" * 64}})])
    with pytest.raises(SourceError, match="sha256 mismatch"):
        pin_inputs(bad)


def test_oci_ref_resolves_to_its_manifest_digest(tmp_path):
    layout = tmp_path / "envdefs" / "img"
    layout.mkdir(parents=True)
    digest = "sha256:" + "ab" * 32
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest,
         "size": 1, "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))
    defs = write_defs(tmp_path, [base("b", src={"oci": {"layout": "img", "ref": "v1"}})])
    assert pin_inputs(defs)["b"]["source"] == digest
    missing = write_defs(tmp_path, [base("b", src={"oci": {"layout": "img", "ref": "v2"}})])
    with pytest.raises(SourceError) as info:
        pin_inputs(missing)
    assert "v2" in info.value.message and "v1" in info.value.hint


def test_debootstrap_has_nothing_to_pin(tmp_path):
    assert dict(pin_inputs(write_defs(tmp_path, [base("b")]))) == {}
