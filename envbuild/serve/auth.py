"""The server's two secrets: API keys for the control plane and one access token per sandbox.

An API key file holds one key per line, plain or as ``sha256:<hex>`` (the SHA-256 of the key,
so the file need not hold the key itself); blank lines and ``#`` comments are skipped. Keys
are kept and compared only as their SHA-256, with ``hmac.compare_digest`` against every
configured digest (no early exit on the first match), so the time a check takes does not
depend on how much of a key was right.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from pathlib import Path

from envbuild.errors import SettingsError
from envbuild.oci import is_digest


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The accepted API keys, as SHA-256 digests."""

    def __init__(self, digests: Iterable[bytes]) -> None:
        self._digests = tuple(digests)

    @classmethod
    def parse(cls, text: str, source: str = "<keys>") -> ApiKeys:
        digests: list[bytes] = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("sha256:"):
                if not is_digest(line.lower()):
                    raise SettingsError(f"{source}:{n}: sha256: needs 64 hex digits",
                                        hint="write `sha256:` + the output of "
                                             "`printf %s KEY | sha256sum`")
                digests.append(bytes.fromhex(line[len("sha256:"):]))
            else:
                digests.append(_digest(line))
        if not digests:
            raise SettingsError(f"{source}: no API key in it",
                                hint="one key per line, plain or sha256:<hex>")
        return cls(digests)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise SettingsError(f"read API key file: {e}",
                                hint="--api-keys FILE: one key per line") from e
        return cls.parse(text, str(path))

    def accepts(self, key: str | None) -> bool:
        if not key:
            return False
        given = _digest(key)
        ok = False
        for d in self._digests:  # every digest, always: no early exit
            ok |= hmac.compare_digest(given, d)
        return ok


def new_token() -> str:
    """A sandbox's access token: 256 random bits."""
    return secrets.token_urlsafe(32)


def same_token(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
