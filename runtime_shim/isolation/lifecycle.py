"""What becomes of a process's sandboxes when it exits (issue 34, item 9).

Harnesses close their sandbox in ``__del__`` (mini-swe-agent does), and at interpreter exit
``__del__`` runs while Python finalizes: ``import`` fails (``sys.meta_path is None``) and a
new thread never runs (``Thread.start`` waits for it forever). Three defences:

- ``close_at_exit`` (an ``atexit`` hook, registered at the first create): closes every sandbox
  this process created and did not close (``keep=True`` ones excepted) while the interpreter
  still works, before any ``__del__`` of a module global runs; a later ``close`` finds it
  closed and returns at once.
- ``exiting()``: true from the hook on and while finalizing; the close path then starts no
  thread (``scratchfs`` closes its loop device fd in the caller). The close path imports nothing at
  call time, so a close that runs during finalization anyway still removes everything.
- For an owner that dies without running its hooks (SIGKILL, ``os._exit``), see
  ``runtime_shim.sdk.exitwatch``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Protocol

_log = logging.getLogger("envbuild.sandbox")


class _Closable(Protocol):
    id: str

    def close(self) -> None: ...


_open: weakref.WeakSet[_Closable] = weakref.WeakSet()
_guard = threading.Lock()
_hooked = False
_exiting = False


def exiting() -> bool:
    """Whether this interpreter is on its way out: ``close_at_exit`` has begun, or it is
    finalizing. Nothing may start a thread or import then."""
    return _exiting or sys.is_finalizing()


def track(sb: _Closable) -> None:
    """``sb`` (created by this process, not kept) is closed at exit unless closed before."""
    global _hooked
    with _guard:
        _open.add(sb)
        if not _hooked:
            atexit.register(close_at_exit)
            _hooked = True


def untrack(sb: _Closable) -> None:
    with _guard:
        _open.discard(sb)


def close_at_exit() -> None:
    """Close every tracked sandbox (the ``atexit`` hook); one that fails never stops the
    others (what it left is removed by ``envbuild sandbox gc``)."""
    global _exiting
    _exiting = True
    with _guard:
        left = list(_open)
    for sb in left:
        try:
            sb.close()
        except Exception as e:  # noqa: BLE001 - at exit there is nobody to raise to
            _log.warning("close sandbox %s at exit: %s", sb.id, e)


def _forget_in_child() -> None:
    """A forked child did not create its parent's sandboxes: never close them at its exit."""
    global _open
    _open = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget_in_child)
