"""Who an envd request runs as: the ``Authorization: Basic base64(USER:)`` header the e2b SDK
sends, resolved against the sandbox's own ``/etc/passwd`` (the agent reads no passwd; the
SDK's ``exec`` takes ``uid:gid``)."""

from __future__ import annotations

import base64
import binascii
import dataclasses

from envbuild.serve.sandboxes import Entry

MAX_PASSWD = 1 << 20


@dataclasses.dataclass(frozen=True)
class User:
    spec: str  # "uid:gid" for Sandbox.exec
    home: str
    named: bool = False  # asked for by name (then HOME is this user's, as E2B's envd sets it)


class UnknownUser(Exception):
    pass


def header_user(authorization: str | None) -> str | None:
    """The user name of a ``Basic`` authorization header, or None."""
    if not authorization or not authorization.startswith("Basic "):
        return None
    try:
        raw = base64.b64decode(authorization[6:], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise UnknownUser("the Authorization header is not Basic base64") from None
    name = raw.partition(":")[0]
    return name or None


def _parse_passwd(text: str) -> dict[str, tuple[str, str]]:
    """name → ("uid:gid", home), and "#uid" → the same."""
    users: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 6 and parts[2].isdigit() and parts[3].isdigit():
            value = (f"{parts[2]}:{parts[3]}", parts[5] or "/")
            users.setdefault(parts[0], value)
            users.setdefault(f"#{parts[2]}", value)
    return users


async def resolve(entry: Entry, name: str | None) -> User:
    """``name`` (None: the lock's user) as the sandbox's passwd has it."""
    if entry.users is None:
        try:
            raw = await entry.sandbox.read_file("/etc/passwd")
        except Exception:  # noqa: BLE001 - no passwd: numeric users and root only
            raw = b""
        entry.users = _parse_passwd(raw[:MAX_PASSWD].decode("utf-8", "replace"))
    if name is None:
        spec = entry.sandbox.lock.user or "0:0"
        found = entry.users.get(f"#{spec.partition(':')[0]}")
        return User(spec if ":" in spec else f"{spec}:{spec}", found[1] if found else "/")
    found = entry.users.get(name)
    if found is not None:
        return User(found[0], found[1], named=True)
    if name == "root":
        return User("0:0", "/root", named=True)
    raise UnknownUser(f"user {name!r} does not exist in the sandbox")


def absolute(path: str, user: User) -> str:
    """E2B's rule: a relative path is relative to the user's home."""
    if path.startswith("/"):
        return path
    return f"{user.home.rstrip('/')}/{path}" if path else user.home
