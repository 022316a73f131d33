"""A layer's import index (``runtime_shim.lazyfs.pyindex``): built from a packed layer's pycs
(the imports ``pydeps.scan`` reads, kept per path), stored as a record beside the blob and
copied with it; read back as untrusted input — another version, another layer's record, and
every kind of damaged entry give no prediction or what was well formed, never an
exception."""

from __future__ import annotations

import json
import py_compile
import random
import sys
import textwrap
from pathlib import Path

import pytest

from envbuild.layers import pack_tree
from envbuild.store import PYIMPORT_RECORDS, LocalStore, copy_layer_records, put_file
from runtime_shim.lazyfs import pydeps, pyindex

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                reason="the scanner reads CPython 3.11 pycs; the suite runs 3.11")

SOURCES = {
    "pkg/__init__.py": "from . import a\nimport json, os.path\n",
    "pkg/a.py": "from .b import thing, other\nclass C:\n    import csv\n"
                "def f():\n    import never\n",
    "pkg/b.py": "thing = other = 1\n",
    "plain.py": "",
}


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for rel, text in SOURCES.items():
        src = root / "opt/lib" / rel
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(textwrap.dedent(text))
        pyc = src.parent / "__pycache__" / f"{src.stem}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(src), str(pyc), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    (root / "opt/lib/not-a-module.pyc").write_bytes(b"not in a __pycache__")
    return root


def _packed(tmp_path: Path, src: Path, store: LocalStore) -> tuple[Path, str]:
    blob = tmp_path / f"{src.name}.layer"
    with open(blob, "wb") as f:
        pack_tree(src, f)
    return blob, put_file(store, blob).digest


def test_a_packed_layers_index_holds_each_pycs_imports_as_scan_reads_them(tmp_path):
    store = LocalStore(tmp_path / "store")
    blob, digest = _packed(tmp_path, _tree(tmp_path), store)
    assert pyindex.index_layer_file(store, str(blob), digest) == len(SOURCES)
    rec = store.get_record(PYIMPORT_RECORDS, digest[7:])
    assert rec is not None and rec["version"] == pyindex.INDEX_VERSION
    index = pyindex.decode_index(json.loads(json.dumps(rec)), digest)
    assert index is not None and len(index) == len(SOURCES)
    tag = sys.implementation.cache_tag
    for rel in SOURCES:
        d, _, leaf = rel.rpartition("/")
        path = f"opt/lib/{d + '/' if d else ''}__pycache__/{leaf[:-3]}.{tag}.pyc"
        data = (tmp_path / "tree" / path).read_bytes()
        assert list(index.imports(path)) == pydeps.scan(data), path
    a = index.imports(f"opt/lib/pkg/__pycache__/a.{tag}.pyc")
    assert [(i.name, i.level, i.fromlist) for i in a] == [
        ("b", 1, ("thing", "other")), ("csv", 0, ())]   # the function's import left out
    assert index.imports(f"opt/lib/__pycache__/plain.{tag}.pyc") == ()   # known, none
    assert index.imports("opt/lib/not-a-module.pyc") is None
    assert index.imports("elsewhere/__pycache__/x.cpython-311.pyc") is None


def test_a_layer_without_pycs_gets_no_record_and_records_travel_with_their_blobs(tmp_path):
    store = LocalStore(tmp_path / "store")
    plain = tmp_path / "plain"
    (plain / "etc").mkdir(parents=True)
    (plain / "etc/hosts").write_text("127.0.0.1 localhost\n")
    blob, digest = _packed(tmp_path, plain, store)
    assert pyindex.index_layer_file(store, str(blob), digest) == 0
    assert store.get_record(PYIMPORT_RECORDS, digest[7:]) is None
    blob2, digest2 = _packed(tmp_path, _tree(tmp_path), store)
    pyindex.index_layer_file(store, str(blob2), digest2)
    other = LocalStore(tmp_path / "other")
    assert copy_layer_records(store, other, [digest, digest2, digest2]) == 1
    assert other.get_record(PYIMPORT_RECORDS, digest2[7:]) == \
        store.get_record(PYIMPORT_RECORDS, digest2[7:])
    assert copy_layer_records(store, other, [digest2]) == 0   # present already


def test_a_damaged_layer_file_is_no_index_and_no_error(tmp_path):
    store = LocalStore(tmp_path / "store")
    bad = tmp_path / "bad.layer"
    bad.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 100)
    assert pyindex.index_layer_file(store, str(bad), "sha256:" + "1" * 64) == 0
    assert pyindex.index_layer_file(store, str(tmp_path / "absent"), "sha256:" + "2" * 64) == 0


def test_indexing_is_cut_short_at_its_time_bound():
    pycs = [(f"m/__pycache__/x{i}.cpython-311.pyc", b"") for i in range(10)]
    assert pyindex.build_index(iter(pycs), "sha256:" + "0" * 64, max_seconds=-1) is None


def test_records_of_another_version_or_layer_are_not_read():
    digest = "sha256:" + "a" * 64
    good = {"version": 1, "layer": digest, "names": ["os"], "pycs": {"p": [0, 0, 0]}}
    assert pyindex.decode_index(good, digest) is not None
    for rec in ({**good, "version": 2}, {**good, "layer": "sha256:" + "b" * 64},
                {**good, "names": "os"}, {**good, "pycs": [["p", [0, 0, 0]]]}, [], None, 7,
                {"version": 1}):
        assert pyindex.decode_index(rec, digest) is None, rec
    assert pyindex.read_index_bytes(b"{not json", digest) is None
    assert pyindex.read_index_bytes(b" " * (pyindex.MAX_RECORD + 1), digest) is None
    assert pyindex.read_index_bytes(json.dumps(good).encode(), digest) is not None


def test_damaged_entries_give_what_was_well_formed_and_never_raise():
    names = ["os", "json", "x" * (pydeps.MAX_NAME + 1), 7, "", "a.b"]
    idx = pyindex.ImportIndex(names, {
        "ok": [0, 0, 0, 5, 0, 1, 1],
        "level": [4, 1, 1, 0, 5, 2, 0],               # from . import os; from ..a.b import
        "bad-name-index": [99, 0, 0, 1, 0, 0],         # skipped, the next kept
        "negative": [-1, 0, 0, 1, 0, 0],
        "too-long-name": [2, 0, 0, 1, 0, 0],
        "not-a-string": [3, 0, 0],
        "bad-level": [0, -1, 0, 1, 0, 0],              # stops there
        "huge-count": [0, 0, 10**9, 1],
        "count-past-end": [0, 0, 5, 1],
        "float": [0.0, 0, 0],
        "not-a-list": {"a": 1},
        "strings": ["os", 0, 0],
        "bool-level": [0, True, 0],
    })
    got = {k: [(i.name, i.level, i.fromlist) for i in idx.imports(k)] for k in idx.pycs}
    assert got["ok"] == [("os", 0, ()), ("a.b", 0, ("json",))]
    assert got["level"] == [("", 1, ("os",)), ("a.b", 2, ())]
    assert got["bad-name-index"] == [("json", 0, ())]
    assert got["negative"] == [("json", 0, ())]
    assert got["too-long-name"] == [("json", 0, ())]
    assert got["bad-level"] == []
    for k in ("not-a-string", "huge-count", "count-past-end", "float", "not-a-list",
              "strings", "bool-level"):
        assert got[k] == [], k
    rng = random.Random(9)
    values = [0, 1, 2, 5, -1, 10**12, None, "os", [], {}, 1.5, True]
    for _ in range(3000):
        flat = [rng.choice(values) for _ in range(rng.randint(0, 30))]
        out = pyindex.ImportIndex(names, {"p": flat}).imports("p")
        assert all(isinstance(i, pydeps.Import) and isinstance(i.name, str) for i in out)
