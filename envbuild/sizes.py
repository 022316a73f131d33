"""The one size grammar: what a user may write for a number of bytes, and how we print one.

``parse_size`` reads a count of bytes in powers of 1024, the way ``ENVBUILD_BUILD_DISK``,
``ENVBUILD_NODE_BUDGET``, ``envbuild snapshot --max-file-size``, a job manifest's ``limits``
and the SDK's sizes are written::

    1024   512B   500M   500 MB   500MiB   2G   2gib   1.5G   0

Units are ``K``, ``M``, ``G``, ``T`` (1024, 1024², ...), optionally followed by ``B`` or
``iB``, any case, with optional blanks between number and unit; a fraction is rounded down to
whole bytes. Anything else (a sign, an exponent, ``inf``, a percentage) is a ``SizeError``:
one line naming the value, with a hint. A percentage is not a size: the one setting that takes
one (``ENVBUILD_NODE_CACHE_MAX``) asks ``parse_percent`` when the text ends in ``%``, as the
node's reserves (``ENVBUILD_HOST_RESERVE``, ``ENVBUILD_DISK_RESERVE``) do.

``format_size`` is the inverse for files we write (``2GiB`` when exact, else the bytes);
``human_size`` is for people (``1.2 MB``, decimal units).
"""

from __future__ import annotations

import re

from envbuild.errors import SizeError

__all__ = ["SIZE_HINT", "UNITS", "SizeError", "format_size", "human_size", "parse_percent",
           "parse_size"]

#: Bytes per unit letter.
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE_HINT = "write bytes or a number with a unit, e.g. 512M, 2GiB, 1.5G (powers of 1024)"
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(?:i?B)?|B)?", re.IGNORECASE)


def parse_size(value: int | str, *, what: str = "size") -> int:
    """``2147483648``, ``"2GiB"``, ``"2G"``, ``"512 MiB"``, ``"1.5G"`` → bytes (powers of 1024).

    An ``int`` (not a ``bool``) is taken as bytes if it is not negative. ``what`` names the
    value in the error (``"ENVBUILD_BUILD_DISK"``, ``"limits.memory"``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if not m:
        raise SizeError(f"{what}: not a size: {value!r}", hint=SIZE_HINT)
    unit = UNITS[(m.group(2) or "").upper()]
    number = m.group(1)
    return int(number) * unit if number.isdigit() else int(float(number) * unit)


def parse_percent(text: str, *, what: str, below_100: bool = False) -> float:
    """``"20%"`` → ``0.2``: a number from 0 to 100 (below 100 with ``below_100``) and ``%``;
    anything else is a ``SizeError`` naming ``what``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*", text)
    share = float(m[1]) if m else -1.0
    if not (0 <= share < 100 if below_100 else 0 <= share <= 100):
        raise SizeError(f"{what} is not a percentage{' below 100%' if below_100 else ''}: "
                        f"{text!r}", hint="e.g. 25%")
    return share / 100


def format_size(n: int) -> int | str:
    """The inverse of ``parse_size`` for what we write: ``2GiB`` if exact, else ``n``."""
    for unit in ("T", "G", "M", "K"):
        if n and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}iB"
    return n


def human_size(n: int | float) -> str:
    """``1.2 MB``-style size (decimal units, one decimal), whole bytes below 1 kB: for people
    (listings, progress lines)."""
    if n < 1000:
        return f"{int(n)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
