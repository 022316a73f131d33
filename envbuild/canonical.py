"""The one canonical JSON encoding, shared by keys, locks, records and manifests.

Sorted keys, compact separators, ASCII only (so the bytes are the same UTF-8 or ASCII), no NaN.
Every digest envbuild computes over JSON is over these bytes; changing this function changes
every key and every lock digest, so it never changes without a new key tag version.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")
