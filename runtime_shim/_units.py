"""Sizes as people write them (``20G``, ``500M``): parsed once for the node cache, the lazy
daemon's command line and the settings. Imports nothing of runtime_shim, so any module can."""

from __future__ import annotations

from envbuild.errors import RuntimeShimError


def parse_size(text: str) -> int:
    """``"20G"``, ``"500M"``, ``"1024"`` → bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        return int(float(t[: len(t) - len(unit)] if unit else t) * units[unit])
    except ValueError:
        raise RuntimeShimError(f"not a size: {text!r}", hint="use e.g. 20G, 500M or 0") from None
