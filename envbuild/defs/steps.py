"""Build steps of a layer definition: ``run`` and ``copy`` (``envbuild.defs.model`` re-exports
them; a step's ``identity()`` feeds its layer's key, its ``name`` does not)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal


def frozen_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A read-only copy of ``value`` (empty for None)."""
    return MappingProxyType(dict(value or {}))


#: A line of a ``run`` script that only sets shell options (``set -eu``, ``set -o pipefail``,
#: ``shopt -s globstar``), with what follows a ``;`` or ``&&`` on the same line as group 1.
_SHELL_OPTIONS_RE = re.compile(r"(?:set|shopt)\s+[-+][^;&]*(?:(?:;|&&)\s*(.*))?")


def run_label(script: str) -> str:
    """What a ``run`` script does, in a line: its first line that is not blank, a comment or a
    shell option setting (``set -eu`` by convention opens every script), trimmed; else its
    first non-blank line."""
    lines = [ln.strip() for ln in script.splitlines() if ln.strip()]
    for line in lines:
        if line.startswith("#"):
            continue
        m = _SHELL_OPTIONS_RE.fullmatch(line)
        if m is None:
            return line
        if m.group(1) and not m.group(1).startswith("#"):
            return m.group(1).strip()
    return lines[0] if lines else ""


@dataclasses.dataclass(frozen=True)
class RunStep:
    """``- run: CMD`` executed with ``/bin/sh -c`` inside the build rootfs. ``name`` (metadata,
    not in the key) says what it does in progress and failures; ``label`` is it, or
    ``run_label`` of the script."""

    run: str
    env: Mapping[str, str] = dataclasses.field(default_factory=lambda: frozen_map(None))
    workdir: str = "/"
    user: str = "0:0"
    network: Literal["host", "none"] = "host"
    name: str | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> RunStep:
        return cls(
            run=m["run"],
            env=frozen_map({k: str(v) for k, v in (m.get("env") or {}).items()}),
            workdir=m.get("workdir", "/"),
            user=str(m.get("user", "0:0")),
            network=m.get("network", "host"),
            name=_step_name(m),
        )

    @property
    def label(self) -> str:
        return self.name or run_label(self.run)

    def identity(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "env": dict(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "network": self.network,
        }


@dataclasses.dataclass(frozen=True)
class CopyStep:
    """``- copy: {src, dest, mode, owner}``: files from the definition's directory.

    ``src`` is relative to the directory of the file that holds the definition; its content is
    hashed into the key by the planner (see ``envbuild.plan.keys``).
    """

    src: str
    dest: str
    mode: int | None = None
    owner: str = "0:0"
    name: str | None = dataclasses.field(default=None, compare=False)  # metadata, as RunStep's

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> CopyStep:
        c = m["copy"]
        mode = c.get("mode")
        if isinstance(mode, str):
            mode = int(mode, 8)
        return cls(src=c["src"], dest=c["dest"], mode=mode, owner=str(c.get("owner", "0:0")),
                   name=_step_name(m))

    @property
    def label(self) -> str:
        return self.name or f"{self.src} -> {self.dest}"

    def identity(self) -> dict[str, Any]:
        # src content enters the key as a digest (added by the planner), not as a path.
        return {"copy": {"dest": self.dest, "mode": self.mode, "owner": self.owner}}


Step = RunStep | CopyStep


def _step_name(m: Mapping[str, Any]) -> str | None:
    """A step's ``name``, whitespace collapsed to single spaces (one line), or None."""
    name = m.get("name")
    if name is None:
        return None
    return " ".join(str(name).split()) or None


def step_from_mapping(m: Mapping[str, Any]) -> Step:
    if "run" in m:
        return RunStep.from_mapping(m)
    return CopyStep.from_mapping(m)

