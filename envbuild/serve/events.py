"""A sandbox's log as ``envbuild serve`` serves it (E2B's ``/sandboxes/{id}/logs``): what the
server did to the sandbox and what ran in it through envd, as events the server saw.

envbuild has no log of a sandbox of its own to give (E2B's is its guest agent's and
orchestrator's log lines): the agent keeps no log, and a command's output belongs to whoever
started it (``commands.run``'s stream). So the log is the server's events for that sandbox:
created (template), timeout changed, paused, resumed, network rules changed, snapshot, fork,
each command started (its pid, command line, user, cwd; never its environment, which may hold
secrets) and ended (exit code, or the error), a command's stream cut because its client fell
``Limits.output_bytes`` behind. Kept in memory, the newest ``MAX_EVENTS`` per
sandbox: a server restart or a kill ends the log.
"""

from __future__ import annotations

import collections
import dataclasses
import time

#: Events kept per sandbox (the oldest go first).
MAX_EVENTS = 1000
#: A message's length at most (a command line can be long).
MAX_MESSAGE = 1024
LEVELS = ("debug", "info", "warn", "error")


@dataclasses.dataclass(frozen=True)
class Event:
    """One event: Unix time, E2B's level, a line, and string fields (``event``: its kind)."""

    at: float
    level: str
    message: str
    fields: dict[str, str]


class EventLog:
    """A sandbox's events, oldest first, at most ``MAX_EVENTS``."""

    def __init__(self) -> None:
        self._events: collections.deque[Event] = collections.deque(maxlen=MAX_EVENTS)

    def note(self, kind: str, message: str, level: str = "info", **fields: str) -> None:
        """Add an event of ``kind`` (e.g. ``process.start``) now."""
        self._events.append(Event(time.time(), level, message[:MAX_MESSAGE],
                                  {"event": kind, **{k: v[:MAX_MESSAGE]
                                                     for k, v in fields.items()}}))

    def select(self, *, start: float | None = None, level: str | None = None,
               search: str | None = None, backward: bool = False,
               limit: int = 1000) -> list[Event]:
        """The events from ``start`` on (or up to it, ``backward``: newest first), at
        ``level`` or above, whose message holds ``search``, at most ``limit``."""
        floor = LEVELS.index(level) if level in LEVELS else 0
        found = [e for e in (reversed(self._events) if backward else self._events)
                 if LEVELS.index(e.level) >= floor and (not search or search in e.message)
                 and (start is None or (e.at <= start if backward else e.at >= start))]
        return found[:limit]
