"""The node's ledger of reservations (``runtime_shim.node.admission`` says what is reserved
and why): one file per reservation and a running total, so that admitting or releasing one
costs the same with 3 or 3,000 sandboxes alive (issue 39).

Layout, under the node cache dir, all written under an exclusive ``flock`` of
``admission.lock``:

- ``admission.d/<key>.json``: one reservation, ``{"files", "tasks", "disk_bytes", "path"}``
  (``<key>`` is ``sandbox:eb-…`` or ``build:…``);
- ``admission.d/totals.json``: ``{"version": 2, "files", "tasks", "disk_bytes", "count"}``,
  the sum of the entries. It is written **before** an entry appears and **after** one goes,
  so a crash between the two leaves it too high, never too low: the node can only admit less
  than it may, and the total is recounted from the entries whenever an admission would
  otherwise be refused (which also drops entries whose ``path`` is gone: an owner that
  vanished without a word) and whenever it is missing.

Version 1 (``admission.json``, every entry in one document read and rewritten at each
admission: 4 ms a create at 300 sandboxes, linear) is converted on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import AdmissionRefused
from runtime_shim.node.admission import (
    HINTS,
    LEDGER_NAME,
    LOCK_NAME,
    RESOURCES,
    WAIT_POLL,
    BudgetSettings,
    NodeBudget,
    Reservation,
    entry_reservation,
    fit,
    node_budget,
    read_host,
    refusal,
)

LEDGER_VERSION = 2
ENTRIES_DIR = "admission.d"
TOTALS = "totals.json"


@dataclasses.dataclass
class _Totals:
    held: Reservation
    count: int


class Ledger:
    """The reservations of one node dir (see the module docstring), in ``dir``."""

    def __init__(self, dir: str | os.PathLike[str]) -> None:
        self.dir = Path(dir)
        self.entries = self.dir / ENTRIES_DIR

    # -- storage -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[_Totals]:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.entries.mkdir(mode=0o700, exist_ok=True)
            self._convert_v1()
            totals = self._read_totals()
            yield totals if totals is not None else self._recount(drop_gone=False)
        finally:
            os.close(fd)

    def _entry_path(self, key: str) -> Path:
        return self.entries / (key.replace("/", "%2F") + ".json")

    def _read_entry(self, path: Path) -> dict | None:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise AdmissionRefused(f"read the admission ledger entry {path}: {e}",
                                   hint="remove it once its sandbox is gone") from None
        return doc if isinstance(doc, dict) else None

    def _read_totals(self) -> _Totals | None:
        try:
            doc = json.loads((self.entries / TOTALS).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION:
            return None
        return _Totals(entry_reservation(doc), int(doc.get("count") or 0))

    def _write_totals(self, totals: _Totals) -> None:
        write_atomic(self.entries / TOTALS, json.dumps(
            {"version": LEDGER_VERSION, **totals.held.to_json(), "count": totals.count}))

    def _all(self) -> Iterator[tuple[str, Path, dict]]:
        for path in self.entries.iterdir():
            if path.name != TOTALS and path.suffix == ".json":
                doc = self._read_entry(path)
                if doc is not None:
                    yield path.stem.replace("%2F", "/"), path, doc

    def _recount(self, *, drop_gone: bool) -> _Totals:
        """The totals from the entries (O(reservations)); with ``drop_gone``, entries whose
        ``path`` no longer exists are removed first."""
        totals = _Totals(Reservation(), 0)
        for _key, path, doc in list(self._all()):
            if drop_gone and not os.path.lexists(str(doc.get("path", ""))):
                path.unlink(missing_ok=True)
                continue
            totals.held, totals.count = totals.held + entry_reservation(doc), totals.count + 1
        self._write_totals(totals)
        return totals

    def _convert_v1(self) -> None:
        old = self.dir / LEDGER_NAME
        if not old.exists():
            return
        try:
            entries = json.loads(old.read_text()).get("entries") or {}
        except (OSError, ValueError, AttributeError):
            entries = {}
        for key, doc in entries.items():
            write_atomic(self._entry_path(key), json.dumps(doc))
        (self.entries / TOTALS).unlink(missing_ok=True)
        old.unlink()

    # -- the ledger --------------------------------------------------------------------------

    def admit(self, key: str, want: Reservation, path: str | os.PathLike[str], *,
              what: str, settings: BudgetSettings, wait: float = 0.0,
              min_disk: int | None = None,
              on_wait: Callable[[str], None] | None = None) -> Reservation:
        """Reserve ``want`` under ``key`` for the thing at ``path`` and return what was
        granted, or raise ``AdmissionRefused``. ``min_disk``: ``want``'s disk may be lowered
        to what the budget has left, down to this (a build's cap is a safety cap, not a
        promise). With ``wait``, a refusal that only others' reservations cause is retried for
        up to that many seconds (a build waits for another build's disk); ``on_wait`` is told
        the refusal's line once, when the waiting starts, so that a user sees why nothing moves."""
        deadline = time.monotonic() + wait
        told = False
        while True:
            with self._locked() as totals:
                budget = node_budget(read_host(self.dir), settings)
                granted, refused = self._try(totals, key, want, path, budget, what, min_disk)
                if refused is None:
                    return granted
                alone = refusal(budget, Reservation(), 0,
                                fit(budget, Reservation(), want, min_disk), what)
            if alone is not None or time.monotonic() >= deadline:
                resource, line = refused
                capped = budget.sources[resource].startswith("ENVBUILD_NODE_BUDGET")
                raise AdmissionRefused(line, hint="close sandboxes, or raise "
                                       "ENVBUILD_NODE_BUDGET" if capped else HINTS[resource])
            if on_wait is not None and not told:
                on_wait(refused[1])
                told = True
            time.sleep(WAIT_POLL)

    def _try(self, totals: _Totals, key: str, want: Reservation, path: str | os.PathLike[str],
             budget: NodeBudget, what: str, min_disk: int | None
             ) -> tuple[Reservation, tuple[str, str] | None]:
        entry_path = self._entry_path(key)
        for attempt in range(2):
            mine = self._read_entry(entry_path)
            held = _minus(totals.held, entry_reservation(mine) if mine else Reservation())
            holders = totals.count - (mine is not None)
            granted = fit(budget, held, want, min_disk)
            refused = refusal(budget, held, holders, granted, what)
            if refused is None:
                self._write_totals(_Totals(held + granted, holders + 1))  # totals first
                write_atomic(entry_path, json.dumps({**granted.to_json(),
                                                     "path": os.fspath(path)}))
                return granted, None
            if attempt == 0:  # a total too high, or owners gone without a word: recount
                totals = self._recount(drop_gone=True)
        return want, refused

    def release(self, key: str) -> None:
        """Forget ``key``'s reservation (idempotent)."""
        path = self._entry_path(key)
        if not path.exists():
            return
        with self._locked() as totals:
            doc = self._read_entry(path)
            if doc is None:
                return
            path.unlink()  # the entry first: a crash leaves the total too high, never low
            self._write_totals(_Totals(_minus(totals.held, entry_reservation(doc)),
                                       max(0, totals.count - 1)))

    def reserved(self) -> dict[str, Reservation]:
        """Every reservation, by key (for ``envbuild node`` listings and tests)."""
        with self._locked():
            return {key: entry_reservation(doc) for key, _path, doc in self._all()}


def _minus(a: Reservation, b: Reservation) -> Reservation:
    return Reservation(*(max(0, getattr(a, r) - getattr(b, r)) for r in RESOURCES))
