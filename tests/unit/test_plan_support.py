"""Helpers for the plan/keys unit tests: build ``DefinitionSet``s directly, no YAML, no loader.

Imported by the other ``test_plan_*``/``test_keys_*`` modules. ``pos`` in a document becomes its
``Origin.field_positions``.
"""

from __future__ import annotations

import hashlib
from types import MappingProxyType
from typing import Any

from envbuild.defs.model import CONSTRUCTORS, CopyStep, DefinitionSet, Origin
from envbuild.plan.keys import PINNED_SOURCE_KINDS, PinnedInputs

DIRS = {"Base": "base", "Workspace": "workspaces", "Toolkit": "toolkits", "Env": "envs"}


def base(name: str, abi: str = "deb12", *, src: dict | None = None, steps=(), **kw) -> dict:
    return {"kind": "Base", "name": name, "abi": abi,
            "from": src or {"debootstrap": {"suite": "bookworm"}}, "steps": list(steps), **kw}


def ws(name: str, build_on: str, *, path: str = "../../sources/x", steps=(), **kw) -> dict:
    return {"kind": "Workspace", "name": name, "build_on": build_on, "source": {"path": path},
            "steps": list(steps), **kw}


def tk(name: str, build_on: str, prefix: str | None = None, *, steps=(), **kw) -> dict:
    return {"kind": "Toolkit", "name": name, "build_on": build_on,
            "prefix": prefix or f"/opt/toolkits/{name}", "steps": list(steps), **kw}


def env(name: str, base: str, workspace: str | None = None, toolkits=(), **kw) -> dict:
    m = {"kind": "Env", "name": name, "base": base, "toolkits": list(toolkits), **kw}
    if workspace is not None:
        m["workspace"] = workspace
    return m


def defset(*docs: dict[str, Any], root: str = "/repo/envdefs") -> DefinitionSet:
    by_name = {}
    for m in docs:
        m = dict(m)
        pos = m.pop("pos", {})
        origin = Origin(file=f"{root}/{DIRS[m['kind']]}/{m['name']}.yaml", line=1, column=1,
                        field_positions=MappingProxyType(pos))
        by_name[m["name"]] = CONSTRUCTORS[m["kind"]](m, origin)
    return DefinitionSet(root=root, by_name=MappingProxyType(by_name))


def fake_pins(defs: DefinitionSet) -> PinnedInputs:
    """Pins derived from the path/url strings: equal strings pin equal, as on a real tree."""
    def h(s: str) -> str:
        return "sha256:" + hashlib.sha256(s.encode()).hexdigest()

    out = {}
    for d in defs.layers:
        pins = {}
        src = getattr(d, "source", None)
        if src is not None and src.kind in PINNED_SOURCE_KINDS:
            pins["source"] = h(repr(src))
        for i, s in enumerate(d.steps):
            if isinstance(s, CopyStep):
                pins[f"steps[{i}].copy.src"] = h(s.src)
        out[d.name] = MappingProxyType(pins)
    return MappingProxyType(out)


def test_defset_builds_every_kind():
    d = defset(base("b"), ws("w", "b"), tk("t", "b"), env("e", "b", "w", ["t"]))
    assert [x.kind for x in d.by_name.values()] == ["Base", "Workspace", "Toolkit", "Env"]
    assert set(fake_pins(d)) == {"b", "w", "t"}
