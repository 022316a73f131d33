"""The runtime side of job manifests: sandbox options from an entry, the pinned-lock check."""

from __future__ import annotations

import dataclasses

import pytest

from envbuild.errors import RuntimeShimError
from envbuild.jobs import create_sandbox, parse_job_manifest, resolve_job_manifest
from envbuild.store import MemoryStore
from runtime_shim.node.locks import resolve
from runtime_shim.sdk.sandbox import Limits
from tests.unit.test_jobs_support import MANIFEST, make_env


def test_sandbox_options_and_lock_check(tmp_path):
    store = MemoryStore()
    make_env(store, tmp_path, "alpha", [{"etc/a": b"a"}])
    make_env(store, tmp_path, "beta", [{"etc/b": b"b"}, {"etc/c": b"c"}])
    m = resolve_job_manifest(parse_job_manifest(MANIFEST), store)
    swe, tools = m.groups
    assert swe.sandbox_options() == {"backend": "container", "network": False,
                                     "limits": Limits(pids=64, memory_bytes=1 << 30)}
    assert tools.sandbox_options()["backend"] == "microvm"
    swe.check_lock(resolve(store, swe.lock))
    with pytest.raises(RuntimeShimError, match="does not close over"):
        swe.check_lock(resolve(store, tools.lock))
    pinned = dataclasses.replace(swe.pinned, config=tools.pinned.config)
    edited = dataclasses.replace(swe, pinned=pinned)
    with pytest.raises(RuntimeShimError, match="does not close over"):
        edited.check_lock(resolve(store, swe.lock))


def test_unresolved_entry_is_refused_before_anything_starts(tmp_path):
    group = parse_job_manifest(MANIFEST).groups[0]
    with pytest.raises(RuntimeShimError, match="not resolved") as e:
        create_sandbox(group, store=MemoryStore(), node_dir=tmp_path)
    assert "envbuild job resolve" in e.value.hint


def test_job_start_imports_no_planning_code():
    import ast
    import inspect

    import envbuild.jobs.model as model
    import envbuild.jobs.start as mod

    for module in (mod, model):  # what a training loop imports to start a job's sandboxes
        imported = {n.module or "" for n in ast.walk(ast.parse(inspect.getsource(module)))
                    if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.startswith(("envbuild.defs", "envbuild.plan",
                                                         "envbuild.jobs.load", "envbuild.build"))}
