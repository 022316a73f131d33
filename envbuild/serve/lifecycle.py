"""A sandbox's lifecycle policy (E2B's ``lifecycle``): what its timeout does — kill it, or
pause it (``autoPause``, with its memory unless ``autoPauseMemory`` is false) — and whether a
request to it while paused resumes it first (``autoResume``).

On the wire (``NewSandbox``/``NewSandboxV2`` of e2b-dev/infra's ``spec/openapi.yml``) a
create carries ``autoPause`` (bool), ``autoPauseMemory`` (bool) and ``autoResume``
(``{"enabled": bool}``); ``get`` reports ``lifecycle`` (``{"onTimeout": "pause"|"kill",
"autoResume": bool}``). A record keeps it as ``to_json``'s object.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: What a timeout does.
ON_TIMEOUT = ("kill", "pause")


class LifecycleRefused(ValueError):
    """A create body's lifecycle fields that cannot be served (one line: the message)."""


@dataclasses.dataclass(frozen=True)
class Lifecycle:
    """``on_timeout``: "kill" or "pause"; ``memory``: a timeout's pause keeps the memory;
    ``auto_resume``: a request to it while paused resumes it, for ``timeout`` seconds (its
    create's timeout)."""

    on_timeout: str = "kill"
    memory: bool = True
    auto_resume: bool = False
    timeout: float = 300.0

    @classmethod
    def from_body(cls, body: dict[str, Any], timeout: float) -> Lifecycle:
        """The policy a create ``body`` asks for; ``LifecycleRefused`` naming what is wrong."""
        pause, memory = body.get("autoPause", False), body.get("autoPauseMemory", True)
        resume = body.get("autoResume")
        for name, value in (("autoPause", pause), ("autoPauseMemory", memory)):
            if not isinstance(value, bool):
                raise LifecycleRefused(f"{name} must be true or false, not {value!r:.40}")
        if resume is None:
            resume = {}
        if not isinstance(resume, dict) or set(resume) - {"enabled"} or not isinstance(
                resume.get("enabled", False), bool):
            raise LifecycleRefused('autoResume must be {"enabled": true|false}, '
                                   f"not {resume!r:.60}")
        auto_resume = resume.get("enabled", False)
        if auto_resume and not pause:
            raise LifecycleRefused("autoResume needs autoPause: true (on_timeout 'pause')")
        if auto_resume and not memory:
            raise LifecycleRefused("autoResume cannot be used with autoPauseMemory: false "
                                   "(a files-only pause is resumed by connect only)")
        return cls(on_timeout="pause" if pause else "kill", memory=memory,
                   auto_resume=auto_resume, timeout=float(timeout))

    def described(self) -> dict[str, Any]:
        """E2B's ``SandboxLifecycle`` (what ``get`` reports)."""
        return {"onTimeout": self.on_timeout, "autoResume": self.auto_resume}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Lifecycle:
        """A record's policy, checked; ``ValueError`` naming the first wrong field."""
        if not isinstance(data, dict) or set(data) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("lifecycle")
        if data["on_timeout"] not in ON_TIMEOUT:
            raise ValueError("lifecycle.on_timeout")
        for name in ("memory", "auto_resume"):
            if not isinstance(data[name], bool):
                raise ValueError(f"lifecycle.{name}")
        t = data["timeout"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < 1 << 32:
            raise ValueError("lifecycle.timeout")
        return cls(**data)
