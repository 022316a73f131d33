"""A package's imports are fetched ahead of the importer (``runtime_shim.lazyfs.pyahead``),
over real passthrough FUSE mounts served by the node daemon from a store directory: the
host's Python imports a package from a lazy "venv" layer whose modules import each other
and a module of a lazy "stdlib" layer (another mount of the same stack). Each module's
``.pyc`` and ``.py`` are larger than any readahead window, so without prediction every one of
them is a miss (the import waits for the store twice per module, one module after the
other); with it, the first pyc's imports and theirs are fetched before the importer opens
them — fewer misses than modules — and a function-level import is not fetched. The same
import without prediction (the default predicts only an interpreter's start-up;
``$ENVBUILD_LAZY_PYDEPS=on`` every import), on a second node, is the baseline of the same run.
An interpreter's start-up files are fetched on the first open of ``bin/python3.N`` by
default."""

from __future__ import annotations

import base64
import hashlib
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envbuild.layers import LayerReader, pack_tree
from envbuild.store import LocalStore, put_file
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool

pytestmark = pytest.mark.integration

SP = "opt/venv/lib/python3.11/site-packages"
STD = "usr/lib/python3.11"
FAN = 5   # pkg imports pkg.m0 .. pkg.m4; m4 imports m5


def _module(path: Path, source: str, pad: int = 1_300_000) -> None:
    """A module with ``source``, 50 ms of work (a real module's body runs too; without it,
    on a loaded host, the importer can catch up with the prediction) and an incompressible
    constant of ``pad`` characters (its pyc and py both larger than a miss window),
    compiled as a checked-hash pyc."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = base64.b64encode(os.urandom(pad * 3 // 4)).decode()
    path.write_text(f"{source}\nimport time\ntime.sleep(0.05)\nPAD = {blob!r}\n")
    pyc = path.parent / "__pycache__" / f"{path.stem}.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(path), str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)


def _layers(tmp_path: Path) -> tuple[Path, Path]:
    venv, std = tmp_path / "venv", tmp_path / "std"
    pkg = venv / SP / "pkg"
    names = ", ".join(f"m{i}" for i in range(FAN))
    _module(pkg / "__init__.py", f"from . import {names}\nimport pydeps_std_mod\n"
                                 "def later():\n    import pkg.only_in_function\n")
    for i in range(FAN - 1):
        _module(pkg / f"m{i}.py", "")
    _module(pkg / f"m{FAN - 1}.py", f"from . import m{FAN}")
    _module(pkg / f"m{FAN}.py", "import json")
    _module(pkg / "only_in_function.py", "")
    _module(std / STD / "pydeps_std_mod.py", "")
    return venv, std


def _pack(src: Path, store: LocalStore, tmp_path: Path) -> tuple[str, str]:
    blob = tmp_path / f"{src.name}.blob"
    with open(blob, "wb") as f:
        pack_tree(src, f)
    digest = put_file(store, blob).digest
    with LayerReader.open_file(blob) as r:
        return digest, r.toc_digest


def _import(node: NodeCache, store: LocalStore, layers: list[tuple[str, str]],
            trace: Path) -> tuple[list[str], dict, dict | None]:
    """Mount the stack (base first) on ``node``, import ``pkg`` from it with the host's
    Python, and return (the files that missed, in order; the venv mount's stats; the
    daemon's import prediction counters)."""
    record = {"key": "sha256:" + os.urandom(32).hex(), "layers": [d for d, _ in layers],
              "store": str(store.root), "s3_endpoint": None}
    mps = [node.ensure_lazy(str(store.root), d, t, record_profile=record) for d, t in layers]
    std_mp, venv_mp = mps
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": f"{venv_mp / SP}:{std_mp / STD}"}
    subprocess.run([sys.executable, "-S", "-c", "import pkg; assert pkg.m5.PAD"],
                   check=True, env=env, timeout=120)
    pred = (daemon_request(node.root, {"op": "ping"}, 10) or {}).get("import_prediction")
    misses = [line.split()[5] for line in trace.read_text().splitlines()
              if line.split()[2] == "miss"]
    return misses, lazy_stats(venv_mp), pred


def test_a_packages_imports_are_fetched_ahead_of_the_importer(tmp_path, monkeypatch):
    require_root()
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    venv, std = _layers(tmp_path)
    store = LocalStore(tmp_path / "store")
    layers = [_pack(std, store, tmp_path), _pack(venv, store, tmp_path)]
    modules = FAN + 3   # pkg, m0..m5, pydeps_std_mod: each a pyc and a py
    runs = {}
    # the default predicts an interpreter's start-up only (no python3.N in these layers)
    for name, switch in (("off", ""), ("on", "on")):
        monkeypatch.setenv("ENVBUILD_LAZY_PYDEPS", switch)
        trace = tmp_path / f"trace-{name}"
        trace.touch()
        monkeypatch.setenv("ENVBUILD_LAZY_OPEN_TRACE", str(trace))
        node = NodeCache(tmp_path / f"node-{name}")
        try:
            runs[name] = _import(node, store, layers, trace)
            log = (node.root / "lazy" / "daemon.log").read_text()
            assert "Traceback" not in log
        finally:
            node.unmount_lazy(keep=())
        assert mounted_targets_under(str(tmp_path / f"node-{name}")) == []
    off_misses, off_stats, off_pred = runs["off"]
    on_misses, on_stats, pred = runs["on"]
    assert off_pred is not None and off_pred["pyc_scanned"] == 0, off_pred
    assert off_pred["files_predicted"] == 0, off_pred
    module_misses = [m for m in off_misses if m.endswith((".py", ".pyc"))]
    # without prediction: every pyc and every source waits for the store
    assert len(module_misses) == 2 * modules, off_misses
    # with it: the first pyc misses (nothing predicts it); the rest was fetched ahead
    on_module_misses = [m for m in on_misses if m.endswith((".py", ".pyc"))]
    assert len(on_module_misses) < modules, on_misses
    assert f"{SP}/pkg/__pycache__/__init__.{sys.implementation.cache_tag}.pyc" \
        in on_module_misses
    assert not any("pydeps_std_mod" in m for m in on_module_misses), on_misses
    # predicted: pkg's source, the pyc and py of m0..m5 and of the stdlib layer's module
    # (json is not in this stack) — those the importer did not open first — and not the
    # function-level import's pair; every prediction was opened
    assert pred["files_predicted"] + pred["unpredicted_opens"] == 2 * modules, pred
    assert pred["unpredicted_opens"] < modules, pred
    assert pred["predicted_opened"] == pred["files_predicted"], pred
    assert pred["pyc_scanned"] == modules, pred
    # and no more bytes than the import itself fetches without prediction (+ slack for
    # coalesced reads' gaps): the prediction fetched nothing the import did not open
    assert on_stats["bytes_fetched"] <= off_stats["bytes_fetched"] + (256 << 10)


def test_an_interpreters_start_up_files_are_fetched_on_its_first_open_by_default(
        tmp_path, monkeypatch):
    """The default mode: the first open of ``usr/bin/python3.11`` fetches ``encodings`` (its
    ``__init__``, ``aliases``, ``utf_8``: pyc and source), ``sitecustomize`` and the site
    dirs' ``.pth`` files before the interpreter opens them — each larger than a miss window,
    so without the prediction each would be a miss — and no pyc is scanned (no helper)."""
    require_root()
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    monkeypatch.delenv("ENVBUILD_LAZY_PYDEPS", raising=False)
    base = tmp_path / "base"
    (base / "usr/bin").mkdir(parents=True)
    (base / "usr/bin/python3.11").write_bytes(os.urandom(2_000_000))
    wanted = []
    for name in ("encodings/__init__.py", "encodings/aliases.py", "encodings/utf_8.py",
                 "sitecustomize.py"):
        path = base / STD / name
        _module(path, "")
        pyc = path.parent / "__pycache__" / f"{path.stem}.cpython-311.pyc"
        if not pyc.exists():   # the host's cache tag may differ: name it as 3.11's
            (path.parent / "__pycache__" / f"{path.stem}.{sys.implementation.cache_tag}.pyc"
             ).rename(pyc)
        wanted += [path, pyc]
    pth = base / "usr/lib/python3/dist-packages/extra.pth"
    pth.parent.mkdir(parents=True)
    pth.write_text("/nowhere\n" + "#" * 1_500_000 + "\n")
    wanted.append(pth)
    control = base / STD / "not_at_start_up.py"
    _module(control, "")
    store = LocalStore(tmp_path / "store")
    digest, toc = _pack(base, store, tmp_path)
    trace = tmp_path / "trace"
    trace.touch()
    monkeypatch.setenv("ENVBUILD_LAZY_OPEN_TRACE", str(trace))
    node = NodeCache(tmp_path / "node")
    try:
        # a sandbox's mounts name their stack (its profile record): lookups go through it
        record = {"key": "sha256:" + os.urandom(32).hex(), "layers": [digest],
                  "store": str(store.root), "s3_endpoint": None}
        mp = node.ensure_lazy(str(store.root), digest, toc, record_profile=record)
        with open(mp / "usr/bin/python3.11", "rb") as f:
            f.read(1)
        files = node.root / "files"
        deadline = time.monotonic() + 30
        names = {hashlib.sha256(p.read_bytes()).hexdigest() for p in wanted}
        while time.monotonic() < deadline and not names <= set(os.listdir(files)):
            time.sleep(0.05)
        assert names <= set(os.listdir(files)), "start-up files not fetched ahead"
        for p in wanted + [control]:
            (mp / p.relative_to(base)).read_bytes()
        pred = (daemon_request(node.root, {"op": "ping"}, 10) or {})["import_prediction"]
        log = (node.root / "lazy" / "daemon.log").read_text()
        assert "Traceback" not in log
    finally:
        node.unmount_lazy(keep=())
    assert mounted_targets_under(str(tmp_path / "node")) == []
    misses = [line.split()[5] for line in trace.read_text().splitlines()
              if line.split()[2] == "miss"]
    rel = [str(p.relative_to(base)) for p in wanted]
    assert not set(rel) & set(misses), misses
    assert str(control.relative_to(base)) in misses   # the control: nothing predicts it
    assert pred["pyc_scanned"] == 0 and pred["files_predicted"] == len(wanted), pred


def test_a_layers_import_index_predicts_the_closure_before_any_of_it_lands(
        tmp_path, monkeypatch):
    """The default mode with layers indexed when packed (``pyindex``, as a build does): the
    daemon reads each layer's index after its mount, and the first open of ``pkg``'s pyc
    resolves pkg's whole import closure at once — no pyc's bytes needed, no scan helper — so
    only that first pyc (and perhaps its source, asked for right after) waits for the store;
    the function-level import is not fetched, every prediction is opened, and no more bytes
    are fetched than without prediction."""
    require_root()
    require_tool("fusermount3")
    from runtime_shim.lazyfs.pyindex import index_layer_file

    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    monkeypatch.delenv("ENVBUILD_LAZY_PYDEPS", raising=False)
    venv, std = _layers(tmp_path)
    # pkg's body works 50 ms before its first import too (as the modules do after theirs):
    # the importer otherwise asks for m0 within a millisecond of pkg's own pyc and source
    init = venv / SP / "pkg" / "__init__.py"
    _module(init, "import time\ntime.sleep(0.05)\n" + init.read_text().split("\nimport time")[0])
    store = LocalStore(tmp_path / "store")
    layers = []
    for src in (std, venv):
        digest, toc = _pack(src, store, tmp_path)
        assert index_layer_file(store, str(tmp_path / f"{src.name}.blob"), digest) > 0
        layers.append((digest, toc))
    modules = FAN + 3
    runs = {}
    for name, switch in (("index", "1"), ("none", "0")):
        monkeypatch.setenv("ENVBUILD_LAZY_PYINDEX", switch)
        trace = tmp_path / f"trace-{name}"
        trace.touch()
        monkeypatch.setenv("ENVBUILD_LAZY_OPEN_TRACE", str(trace))
        node = NodeCache(tmp_path / f"node-{name}")
        try:
            record = {"key": "sha256:" + os.urandom(32).hex(), "layers": [d for d, _ in layers],
                      "store": str(store.root), "s3_endpoint": None}
            for d, t in layers:
                node.ensure_lazy(str(store.root), d, t, record_profile=record)
            deadline = time.monotonic() + 20   # read in the background after each mount
            indexes: dict = {}
            while time.monotonic() < deadline and len(indexes) < 2:
                indexes = (daemon_request(node.root, {"op": "ping"}, 10) or {})[
                    "import_indexes"]
                time.sleep(0.02)
            assert set(indexes) == {d for d, _ in layers}, indexes
            runs[name] = _import(node, store, layers, trace)
            log = (node.root / "lazy" / "daemon.log").read_text()
            assert "Traceback" not in log and "import index of" in log
        finally:
            node.unmount_lazy(keep=())
        assert mounted_targets_under(str(tmp_path / f"node-{name}")) == []
    misses, stats, pred = runs["index"]
    none_misses, none_stats, none_pred = runs["none"]
    first = f"{SP}/pkg/__pycache__/__init__.{sys.implementation.cache_tag}.pyc"
    module_misses = [m for m in misses if m.endswith((".py", ".pyc"))]
    assert first in module_misses and set(module_misses) <= {first, f"{SP}/pkg/__init__.py"}, \
        misses
    # the switch off: the index is read but unused, every module waits for the store
    assert len([m for m in none_misses if m.endswith((".py", ".pyc"))]) == 2 * modules
    assert none_pred["pyc_scanned"] == 0 and none_pred["files_predicted"] == 0, none_pred
    assert pred["pyc_scanned"] == modules and pred["scan_seconds"] < 0.05, pred
    assert pred["predicted_opened"] == pred["files_predicted"], pred
    assert pred["files_predicted"] + pred["unpredicted_opens"] == 2 * modules, pred
    assert not any("only_in_function" in m for m in misses)
    assert stats["bytes_fetched"] <= none_stats["bytes_fetched"] + (256 << 10)
