""""Did you mean" hints, shared by the definition loader (unknown keys, kinds, enum values), the
graph (unknown references) and the layer tools (unknown member paths). It imports nothing of
envbuild, so every package may use it (``envbuild.layers`` is below ``envbuild.defs``).

``suggest`` returns the whole hint text so callers can pass it straight to ``Problem(hint=...)``;
``closest`` returns just the candidate. Both use ``difflib`` similarity (cutoff 0.6), which is
cheap for the handful of keys allowed at one place in a schema; over 100,000 definition names a
call costs a noticeable fraction of a second, so call it once per problem, never per definition.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name``, or None when nothing is close enough."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """``"did you mean 'toolkits'?"`` for the closest candidate, or None."""
    match = closest(name, candidates)
    return None if match is None else f"did you mean {match!r}?"
