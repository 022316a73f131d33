"""``FnPool``: warm FnCall sandboxes serving stateless calls from any number of threads.

A pool of ``Sandbox``es of the ``fncall`` backend (``runtime_shim.backends.fncall``), so it
sits in the SDK above the backend and the backend never imports the ``Sandbox`` class.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from envbuild.errors import RuntimeShimError
from runtime_shim.backends.base import StatelessCalls
from runtime_shim.node.model import ExecResult
from runtime_shim.sdk.sandbox import Sandbox


class FnPool:
    """``size`` warm fncall sandboxes of ``lock`` serving ``call`` from any number of threads
    (each call waits for a free sandbox). A call's leftover processes are killed as it returns;
    its layer is reset when the sandbox is next taken (in the calling thread: no thread per
    call). A sandbox whose reset fails is closed and replaced in the background while the call
    takes another. Use as a context manager; ``close`` removes every sandbox. Keyword
    arguments go to ``Sandbox.create``."""

    def __init__(self, lock: str, size: int = 2, **create: Any) -> None:
        if size < 1:
            raise RuntimeShimError(f"FnPool size must be at least 1, not {size}")
        self._lock, self._create = lock, {**create, "backend": "fncall"}
        self._free: queue.Queue[Sandbox] = queue.Queue()
        self._all: list[Sandbox] = []
        self._guard = threading.Lock()
        self._recycling: set[threading.Thread] = set()
        self._closed = False
        self.last_error: str | None = None  # of the last failed reset or replacement
        try:
            for _ in range(size):
                sb = Sandbox.create(lock, **self._create)
                self._all.append(sb)
                self._free.put(sb)
        except BaseException:
            self.close()
            raise

    def call(self, argv: str | Sequence[str], *, stdin: bytes | str | None = None,
             files: Mapping[str, bytes | str] | None = None, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None) -> ExecResult:
        """One stateless call (``Sandbox.call``) on the next free sandbox."""
        while True:
            sb = self._take()
            handle = sb._backend
            assert isinstance(handle, StatelessCalls)  # a sandbox of the fncall backend
            try:
                handle.reset()  # the previous call's layer (a no-op when clean)
            except Exception as e:
                self.last_error = str(e)
                worker = threading.Thread(target=self._recycle, args=(sb,), daemon=True,
                                          name="envbuild-fncall-replace")
                with self._guard:
                    self._recycling.add(worker)
                worker.start()
                continue
            try:
                return sb.call(argv, stdin=stdin, files=files, timeout=timeout, env=env,
                               cwd=cwd, user=user)
            finally:
                self._free.put(sb)

    def _take(self) -> Sandbox:
        """The next free sandbox; ``RuntimeShimError`` once none is left (closed, or every
        replacement failed)."""
        while True:
            if self._closed:
                raise RuntimeShimError("the FnPool is closed")
            try:
                return self._free.get(timeout=0.2)
            except queue.Empty:
                with self._guard:
                    gone = not self._all and not self._recycling
                if gone:
                    raise RuntimeShimError("the FnPool has no sandbox left",
                                           context=self.last_error,
                                           hint="see last_error; close it and make another"
                                           ) from None

    def _recycle(self, sb: Sandbox) -> None:
        """Replace ``sb``, whose reset failed (in a background thread)."""
        try:
            try:
                self._replace(sb)
            except Exception as e:  # the pool runs on with one sandbox fewer
                self.last_error = str(e)
        finally:
            with self._guard:
                self._recycling.discard(threading.current_thread())

    def _replace(self, sb: Sandbox) -> None:
        with self._guard:
            if sb in self._all:
                self._all.remove(sb)
        with contextlib.suppress(Exception):  # a broken sandbox: its dir stays for gc
            sb.close()
        if not self._closed:
            new = Sandbox.create(self._lock, **self._create)
            with self._guard:
                self._all.append(new)
            self._free.put(new)

    @property
    def sandboxes(self) -> list[Sandbox]:
        with self._guard:
            return list(self._all)

    def close(self) -> None:
        self._closed = True
        while True:  # a replacement in flight creates a sandbox: let it finish first
            with self._guard:
                busy = list(self._recycling)
            if not busy:
                break
            for worker in busy:
                worker.join()
        with self._guard:
            everything, self._all = self._all, []
        errors = []
        for sb in everything:
            try:
                sb.close()
            except Exception as e:  # close the others; raise the first afterwards
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> FnPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

