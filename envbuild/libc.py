"""The one binding of the C library, for every module that calls it through ctypes.

``LIBC`` is the C library this process already has loaded (``CDLL(None)``): no
``ctypes.util.find_library``, which runs ``ldconfig`` in a subprocess at import (slow, and a
process spawned by merely importing a module), and no second handle of it. ``use_errno``: a
failing call's ``errno`` is read with ``ctypes.get_errno()``.

Attributes of one ``CDLL`` are shared by everyone who reads them (``LIBC.mount`` is one
object), so a caller that sets ``argtypes`` or ``restype`` takes its own function object with
``function`` instead: two modules can never change each other's types.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

LIBC = ctypes.CDLL(None, use_errno=True)


def function(name: str, restype: Any = ctypes.c_int, argtypes: Sequence[Any] | None = None
             ) -> Any:
    """A foreign function of the C library of its caller's own (``CDLL.__getitem__`` makes a
    new one each time), with these types."""
    func = LIBC[name]
    func.restype = restype
    if argtypes is not None:
        func.argtypes = list(argtypes)
    return func
