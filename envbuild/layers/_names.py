"""Member names a layer or a foreign tar may hold, and the names OCI reserves for whiteouts.

The one place the naming rules of ``docs/layer-format.md`` ("Reader safety") are checked: the
unpackers (``_unpack``, ``_untar``), the verifier and the whiteout handling all call these.
"""

from __future__ import annotations

from envbuild.errors import UnsafeLayerError

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"


def check_member_name(name: str, path: str, what: str = "member") -> list[str]:
    """The components of a safe relative member name, or ``UnsafeLayerError``."""
    if not path:
        raise UnsafeLayerError(f"layer {name}: {what} with an empty name")
    if path.startswith("/"):
        raise UnsafeLayerError(f"layer {name}: {what} {path!r} has an absolute path")
    parts = path.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise UnsafeLayerError(f"layer {name}: {what} {path!r} has a "
                                   f"{'..' if p == '..' else 'empty or .'} path component")
    return parts


def foreign_member_name(name: str, path: str, what: str = "member") -> list[str]:
    """The components of a foreign tar's member name: ``/`` and ``.`` components dropped
    (``./etc/passwd`` and ``/etc/passwd`` are ``etc/passwd``), ``..`` refused; [] for the root."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayerError(f"{name}: {what} {path!r} has a '..' path component")
    return parts


def check_whiteout_target(name: str, path: str, base: str) -> None:
    """``UnsafeLayerError`` unless whiteout ``base`` (``.wh.NAME``) names one file of its
    directory."""
    if base[4:] in ("", ".", "..") or "/" in base[4:]:
        raise UnsafeLayerError(f"layer {name}: whiteout {path!r} names no file")
