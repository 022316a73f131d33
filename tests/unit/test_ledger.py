"""The node's ledger (``runtime_shim.node.ledger``): one file per reservation and a running
total, so that an admission costs the same whatever is reserved; the total only ever errs
high and is recounted when it would refuse; version 1 is converted."""

from __future__ import annotations

import json

import pytest

from envbuild.errors import AdmissionRefused
from runtime_shim.node.admission import BudgetSettings, Reservation
from runtime_shim.node.ledger import ENTRIES_DIR, TOTALS, Ledger

MiB = 1 << 20
SETTINGS = BudgetSettings(caps={"disk_bytes": 100 * MiB, "files": 10_000, "tasks": 1_000})


def _admit(ledger: Ledger, key: str, disk: int, path) -> Reservation:
    return ledger.admit(key, Reservation(files=10, tasks=2, disk_bytes=disk), path,
                        what=key, settings=SETTINGS)


def _totals(tmp_path) -> dict:
    return json.loads((tmp_path / ENTRIES_DIR / TOTALS).read_text())


def test_admit_and_release_keep_the_total(tmp_path):
    ledger = Ledger(tmp_path)
    _admit(ledger, "sandbox:a", 30 * MiB, tmp_path)
    _admit(ledger, "sandbox:b", 30 * MiB, tmp_path)
    _admit(ledger, "sandbox:a", 40 * MiB, tmp_path)    # again: replaces its own entry
    assert _totals(tmp_path) == {"version": 2, "files": 20, "tasks": 4,
                                 "disk_bytes": 70 * MiB, "count": 2}
    with pytest.raises(AdmissionRefused, match=r"needs 40 MiB, 70 MiB reserved by 2 other"):
        _admit(ledger, "sandbox:c", 40 * MiB, tmp_path)
    ledger.release("sandbox:a")
    ledger.release("sandbox:a")                        # idempotent
    assert set(ledger.reserved()) == {"sandbox:b"}
    assert _totals(tmp_path)["disk_bytes"] == 30 * MiB and _totals(tmp_path)["count"] == 1


def test_an_admission_reads_no_other_entry(tmp_path, monkeypatch):
    ledger = Ledger(tmp_path)
    for i in range(50):
        ledger.admit(f"sandbox:{i}", Reservation(files=1), tmp_path, what="s",
                     settings=SETTINGS)
    monkeypatch.setattr(Ledger, "_all", lambda self: pytest.fail("read every entry"))
    ledger.admit("sandbox:new", Reservation(files=1), tmp_path, what="s", settings=SETTINGS)
    ledger.release("sandbox:3")


def test_a_total_left_too_high_by_a_crash_is_recounted_when_it_would_refuse(tmp_path):
    ledger = Ledger(tmp_path)
    _admit(ledger, "sandbox:a", 30 * MiB, tmp_path)
    gone = tmp_path / "gone"
    gone.mkdir()
    _admit(ledger, "sandbox:vanished", 30 * MiB, gone)
    gone.rmdir()                                       # its owner vanished without a word
    doc = _totals(tmp_path)
    (tmp_path / ENTRIES_DIR / TOTALS).write_text(json.dumps({**doc, "disk_bytes": 99 * MiB}))
    assert _admit(ledger, "sandbox:c", 60 * MiB, tmp_path).disk_bytes == 60 * MiB
    assert set(ledger.reserved()) == {"sandbox:a", "sandbox:c"}
    assert _totals(tmp_path)["disk_bytes"] == 90 * MiB


def test_a_missing_total_is_recounted(tmp_path):
    ledger = Ledger(tmp_path)
    _admit(ledger, "sandbox:a", 30 * MiB, tmp_path)
    (tmp_path / ENTRIES_DIR / TOTALS).unlink()
    with pytest.raises(AdmissionRefused):
        _admit(ledger, "sandbox:b", 80 * MiB, tmp_path)
    assert _totals(tmp_path)["disk_bytes"] == 30 * MiB


def test_a_version_1_ledger_is_converted(tmp_path):
    (tmp_path / "admission.json").write_text(json.dumps({"version": 1, "entries": {
        "sandbox:old": {"files": 5, "tasks": 1, "disk_bytes": 50 * MiB, "path": str(tmp_path)},
        "build:x": {"files": 0, "tasks": 0, "disk_bytes": 10 * MiB, "path": str(tmp_path)}}}))
    ledger = Ledger(tmp_path)
    assert ledger.reserved() == {"sandbox:old": Reservation(5, 1, 50 * MiB),
                                 "build:x": Reservation(0, 0, 10 * MiB)}
    assert not (tmp_path / "admission.json").exists()
    with pytest.raises(AdmissionRefused, match="60 MiB reserved by 2 other"):
        _admit(ledger, "sandbox:new", 50 * MiB, tmp_path)
