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


#: Bytes of one JSON document envbuild parses from outside (a store, an OCI layout, a file):
#: manifests, configs, indexes and records are KBs; a layer where a manifest was expected is not.
MAX_JSON_BYTES = 64 << 20
#: JSON values (counted as commas) in one such document: 64 MiB of ``[],`` would decode to 21
#: million lists (1.2 GB); a store index of 100,000 refs has ~1 million values.
MAX_JSON_VALUES = 4_000_000


class JsonLimitError(ValueError):
    """A JSON document over a limit (size or nesting). A ``ValueError``, like ``json``'s own
    errors, so every "not valid JSON" handler already turns it into a one-line error."""


def load_json(data: bytes | str, *, max_bytes: int = MAX_JSON_BYTES,
              max_values: int = MAX_JSON_VALUES) -> Any:
    """``json.loads`` for documents from outside: refuses more than ``max_bytes``, more than
    ``max_values`` values (commas, counted before parsing) and nesting deeper than the
    interpreter's recursion limit (``json`` raises ``RecursionError`` there, which a
    ``ValueError`` handler lets through as a traceback) with ``JsonLimitError``."""
    if len(data) > max_bytes:
        raise JsonLimitError(f"document is {len(data)} bytes, over the {max_bytes}-byte limit")
    commas = data.count(b",") if isinstance(data, bytes) else data.count(",")
    if commas > max_values:
        raise JsonLimitError(f"document has more than {max_values} values, the limit")
    try:
        return json.loads(data)
    except RecursionError:
        raise JsonLimitError("document is nested too deeply") from None


def read_json_file(path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``load_json`` of a file, reading at most ``max_bytes + 1`` bytes of it (``OSError``s
    propagate)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    return load_json(data, max_bytes=max_bytes)
