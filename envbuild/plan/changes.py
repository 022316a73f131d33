"""Change detection: what must be rebuilt and re-locked between two ``KeySet``s. Pure.

The two key sets come from the same definition tree at two moments (a git revision and the
working tree); getting them is a side effect (``envbuild.build.gitrev``), comparing them is not.

- A layer must be **rebuilt** when its key did not exist before, under any name: a renamed but
  otherwise identical layer has a key that is already built, so it costs nothing.
- An env must be **re-locked** when its lock inputs digest changed (any of its layer keys, their
  order, or any config that reaches its lock) or it is new.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from envbuild.plan.keys import KeySet

ABSENT = "(absent)"


@dataclasses.dataclass(frozen=True)
class Changes:
    rebuild: tuple[str, ...]
    relock: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rebuild": list(self.rebuild), "relock": list(self.relock)}


def diff_keys(old: KeySet, new: KeySet) -> Changes:
    """Layers of ``new`` to rebuild and envs of ``new`` to re-lock, relative to ``old``."""
    built = set(old.layers.values())
    rebuild = sorted(n for n, k in new.layers.items() if k not in built)
    relock = sorted(n for n, d in new.env_locks.items() if old.env_locks.get(n) != d)
    return Changes(rebuild=tuple(rebuild), relock=tuple(relock))


@dataclasses.dataclass(frozen=True)
class InputChange:
    """One leaf of a key input dict that differs: ``steps[1].run: 'a' -> 'b'``."""

    path: str
    old: Any
    new: Any

    def render(self) -> str:
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


def _show(v: Any) -> str:
    return v if v is ABSENT else repr(v)


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts/lists as (``a.b[2].c``, value), in sorted key order.

    Empty dicts and lists are leaves themselves, so ``{}`` vs ``{"x": 1}`` still shows up.
    """
    if isinstance(obj, Mapping) and obj:
        for k in sorted(obj):
            yield from flatten(obj[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)) and obj:
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, (list(obj) if isinstance(obj, tuple) else obj)


def diff_inputs(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[InputChange]:
    """Which key inputs changed, leaf by leaf (``None`` = the definition did not exist)."""
    a = dict(flatten(old or {}))
    b = dict(flatten(new or {}))
    out = []
    for path in sorted(a.keys() | b.keys()):
        va, vb = a.get(path, ABSENT), b.get(path, ABSENT)
        if va != vb:
            out.append(InputChange(path, va, vb))
    return out


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Why a definition has the key (layer) or lock digest (env) it has."""

    name: str
    kind: str
    digest: str  # layer key, or env lock inputs digest
    inputs: Mapping[str, Any]
    old_digest: str | None = None
    changes: tuple[InputChange, ...] | None = None  # None: no revision to compare against

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "digest": self.digest,
                               "inputs": self.inputs}
        if self.changes is not None:
            out["against"] = {"digest": self.old_digest,
                              "changes": [{"path": c.path, "old": c.old, "new": c.new}
                                          for c in self.changes]}
        return out


def explain(name: str, kind: str, new: KeySet, old: KeySet | None = None) -> Explanation:
    """The inputs behind ``name``'s key in ``new`` and, given ``old``, which of them changed."""
    if kind == "Env":
        digest, inputs = new.env_locks[name], new.env_inputs[name]
        old_digest = old.env_locks.get(name) if old else None
        old_inputs = old.env_inputs.get(name) if old else None
    else:
        digest, inputs = new.layers[name], new.inputs[name]
        old_digest = old.layers.get(name) if old else None
        old_inputs = old.inputs.get(name) if old else None
    changes = tuple(diff_inputs(old_inputs, inputs)) if old is not None else None
    return Explanation(name=name, kind=kind, digest=digest, inputs=inputs,
                       old_digest=old_digest, changes=changes)
