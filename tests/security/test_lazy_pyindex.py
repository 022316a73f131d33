"""A hostile import index (``runtime_shim.lazyfs.pyindex``) in the store, read by the real
native filler (fanotify pre-content events) for a real runc sandbox: anyone who can write the
store's records can replace a layer's index. Names that climb out of the tree (``..``,
``/etc``, absolute and dotted paths), string-table indexes out of range, a fromlist of ten
thousand names, entries of every wrong type, a record naming another layer, a record that is
not JSON and one over ``MAX_RECORD`` must neither crash nor wedge the filler nor fill
anything but the stack's own modules: the sandbox reads every file's right bytes, the
filler's log has no traceback, the files no good import names stay unfilled, and no object
is made for anything outside the layer."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envbuild.store import PYIMPORT_RECORDS
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import native
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.lazyfs.pyindex import MAX_RECORD, index_layer_file
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox, gc_sandboxes, layers_in_use
from tests.integration.test_lazy_native import _env, _pyc

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                 reason="the index holds CPython 3.11 pycs; the suite runs 3.11")]

LIB = "usr/lib/python3.11"
#: Modules under ``LIB``; ``../secret/keys`` lies outside every import root of the stack.
MODS = {"pkg/__init__": "from . import a\n", "pkg/a": "import pkg.b\n", "pkg/b": "X = 1\n",
        "../secret/keys": "K = 2\n", "unrelated": "Y = 3\n"}


def _pyc_path(mod: str) -> str:
    head, _, name = os.path.normpath(f"{LIB}/{mod}").rpartition("/")
    return f"{head}/__pycache__/{name}.cpython-311.pyc"


def _py_path(mod: str) -> str:
    return os.path.normpath(f"{LIB}/{mod}") + ".py"


def _files() -> dict[str, bytes]:
    """The layer: package ``pkg`` (``pkg.a``, ``pkg.b``), a ``secret.keys`` and an
    ``unrelated`` module nothing imports; each opened pyc followed by a large file, which ends
    its blob-order window, so only a prediction fills what comes after it."""
    files = {_py_path(m): src.encode() for m, src in MODS.items()}
    files.update({_pyc_path(m): _pyc(src) for m, src in MODS.items()})
    files[f"{LIB}/pkg/__pycache__/__init__.cpython-311.pyd"] = os.urandom(2 << 20)
    return files


HOSTILE_NAMES = ["..", "../../secret/keys", "/etc/passwd", "secret.keys", "secret", "pkg",
                 "a" * 10_000, "", "pkg.b", "unrelated/../secret"]


def _hostile(digest: str, first: str) -> dict:
    return {"version": 1, "layer": digest, "names": HOSTILE_NAMES + [7, None, ["x"]],
            "pycs": {first: [0, 0, 0, 1, 0, 0, 2, 0, 0, 3, 0, 0, 4, 5, 0,   # climbing names
                             6, 0, 0, 99, 0, 0, -3, 0, 0, 9, 0, 0, 10, 0, 0,  # long, bad refs
                             7, 3, 1, 1, 7, 99, 0,                          # levels past the top
                             5, 0, 10_000, *([3] * 10_000),                 # a huge fromlist
                             8, 0, 0],                                      # one good import
                     _pyc_path("pkg/a"): "not a list",
                     "../../etc/passwd": [5, 0, 0],
                     "/abs/__pycache__/x.cpython-311.pyc": [0, 0, 0]}}


@contextlib.contextmanager
def _node(tmp_path: Path, tag: str) -> Iterator[Path]:
    """A node dir of its own (a filler reads a layer's index once); afterwards, as `node gc`:
    no sandbox, mount or filler left."""
    node_dir = tmp_path / f"n-{tag}"
    try:
        yield node_dir
    finally:
        gc_sandboxes(node_dir)
        NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 0)
    assert mounted_targets_under(str(node_dir)) == []
    assert native.filler_request(str(node_dir / "node"), {"op": "ping"}, 1.0) is None


def _stack_objects(store, layers) -> set[str]:
    """The objects the stack's regular files may have: their TOC digests."""
    from envbuild.layers import LayerReader

    out = set()
    for x in layers:
        with LayerReader.open_file(store.blob_path(x.digest)) as r:
            out |= {e.digest[7:] for e in r.entries() if e.type == "file" and e.digest}
    return out


def _run(node_dir: Path, store, layers, files: dict[str, bytes]) -> tuple[set[str], str]:
    """A native sandbox reads ``pkg/__init__``'s pyc, then (once the filler settled) every
    file of the layer, checked byte for byte. Returns the files filled before that full read
    (the opened one, what its open predicted) and the filler's log."""
    objects = ObjectStore(node_dir / "node")
    by_hex = {hashlib.sha256(data).hexdigest(): rel for rel, data in files.items()}
    with Sandbox.create("py", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec(f"cat /{_pyc_path('pkg/__init__')} >/dev/null").exit_code == 0
        deadline, seen = time.monotonic() + 3, -1
        while time.monotonic() < deadline:   # predictions run after the open: let them land
            ping = native.filler_request(str(node_dir / "node"), {"op": "ping"}) or {}
            assert ping.get("ok"), ping            # the filler serves on
            if ping.get("fills") == seen:
                break
            seen = ping.get("fills")
            time.sleep(0.3)
        early = {rel for hexd, rel in by_hex.items() if objects.complete(hexd)}
        made = {n for n in os.listdir(objects.data) if not n.startswith(".")}
        allowed = _stack_objects(store, layers)
        assert made <= allowed, made - allowed   # no object for anything outside the stack
        r = sb.exec("cd / && sha256sum " + " ".join(sorted(files)))
        assert r.exit_code == 0, r.stderr
        got = dict(reversed(line.split()) for line in r.stdout.decode().splitlines())
        assert got == {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    log_path = node_dir / "node" / "objects" / "filler.log"
    return early, log_path.read_text(errors="replace") if log_path.exists() else ""


CLOSURE = {_py_path("pkg/a"), _pyc_path("pkg/a"), _py_path("pkg/b"), _pyc_path("pkg/b")}
NEVER = {_py_path("../secret/keys"), _pyc_path("../secret/keys"), _py_path("unrelated"),
         _pyc_path("unrelated")}


def test_a_hostile_index_is_bounded_and_fills_nothing_outside_the_modules(tmp_path):
    files = _files()
    store, layers = _env(tmp_path, "py", files)
    digest = layers[1].digest
    assert index_layer_file(store, str(store.blob_path(digest)), digest) == 5
    with _node(tmp_path, "good") as node_dir:   # the real index: pkg's closure, nothing else
        early, log = _run(node_dir, store, layers, files)
    assert CLOSURE <= early and not early & NEVER, (early, log[-2000:])

    store.put_record(PYIMPORT_RECORDS, digest[7:], _hostile(digest, _pyc_path("pkg/__init__")))
    with _node(tmp_path, "hostile") as node_dir:
        early, log = _run(node_dir, store, layers, files)
    assert "Traceback" not in log, log[-3000:]
    assert not early & NEVER, (early & NEVER, log[-2000:])   # nothing a bad entry names


@pytest.mark.parametrize("kind", ["not json", "another layer's", "oversized"])
def test_an_unusable_index_record_is_no_index(tmp_path, kind):
    """A record that is not JSON, one naming another layer, and one over ``MAX_RECORD``
    (whose content would predict ``unrelated``: were it read, that file would be filled) are
    each no index: no prediction, no traceback, every byte right."""
    files = _files()
    store, layers = _env(tmp_path, "py", files)
    digest = layers[1].digest
    rec = {"version": 1, "layer": digest, "names": ["unrelated", "secret.keys"],
           "pycs": {_pyc_path("pkg/__init__"): [0, 0, 0, 1, 0, 0]}}
    path = store.root.joinpath(*PYIMPORT_RECORDS.split("/"), digest[7:])
    if kind == "another layer's":
        store.put_record(PYIMPORT_RECORDS, digest[7:], {**rec, "layer": "sha256:" + "e" * 64})
    elif kind == "oversized":
        rec["names"] += ["p" * 1000] * (MAX_RECORD // 1000 + 1)
        store.put_record(PYIMPORT_RECORDS, digest[7:], rec)
        assert path.stat().st_size > MAX_RECORD
    else:
        store.put_record(PYIMPORT_RECORDS, digest[7:], rec)
        path.write_bytes(b'{"version": 1, "names": [' + b"[" * 100_000)
    with _node(tmp_path, "x") as node_dir:
        early, log = _run(node_dir, store, layers, files)
    assert "Traceback" not in log, log[-3000:]
    assert not early & NEVER, (early & NEVER, log[-2000:])
