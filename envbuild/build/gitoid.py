"""A git object id: 40 (SHA-1) or 64 (SHA-256) hex digits, lower case as git prints them —
the one copy of that fact (a commit a definition pins, what ``rev-parse`` and ``ls-remote``
print, what the revision reader reads)."""

from __future__ import annotations

import re

GIT_OID_PATTERN = r"[0-9a-f]{40}|[0-9a-f]{64}"
_GIT_OID = re.compile(GIT_OID_PATTERN)


def is_git_oid(text: str) -> bool:
    """``text`` is a full object id in git's own spelling (lower case)."""
    return _GIT_OID.fullmatch(text) is not None
