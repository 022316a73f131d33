"""``envbuild.serve.records``: a record written is read back the same; a record is hostile
input on read (links, FIFOs, other files, oversize, wrong fields, a name that is not its id are
skipped, never acted on); at most ``limit`` are read; one server owns a directory."""

from __future__ import annotations

import json
import os

import pytest

from envbuild.errors import SettingsError
from envbuild.serve.records import MAX_RECORD, Record, RecordDir

TOKEN = "A" * 43


def _record(**changes) -> Record:
    fields = dict(id="i0123456789abcdef012", template="busybox-shell", metadata={"a": "b"},
                  env_vars={}, started_at=1.5, end_at=100.0, token=TOKEN,
                  traffic_token="B" * 43, cpus=2, memory_mb=512, disk_mb=1024,
                  sandbox="eb-0123abcd")
    fields.update(changes)
    return Record(**fields)


@pytest.fixture
def records(tmp_path):
    d = RecordDir(tmp_path / "serve")
    d.claim()
    yield d
    d.release()


def test_a_record_round_trips_private(records):
    rec = _record()
    records.write(rec)
    path = records.path / f"{rec.id}.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert records.path.stat().st_mode & 0o777 == 0o700
    assert records.load(10) == [rec]
    records.remove(rec.id)
    assert records.load(10) == []
    records.remove("../../etc/passwd")  # not an id: nothing happens


def test_a_fleet_sandbox_record_round_trips(records):
    rec = _record(sandbox="eb-0123456789ab@0123456789ab")  # envbuild serve --fleet
    records.write(rec)
    assert records.load(10) == [rec]


@pytest.mark.parametrize("change", [
    {"sandbox": "eb-1@2@0123456789ab"}, {"sandbox": "eb-1@../../x"},
    {"sandbox": "eb-1@0123456789AB"}, {"sandbox": "@0123456789ab"},
    {"version": 2}, {"id": "../x"}, {"id": "I0123456789ABCDEF012"}, {"token": "short"},
    {"token": "a b" * 20}, {"template": ""}, {"template": "x" * 5000}, {"metadata": {"a": 1}},
    {"metadata": []}, {"env_vars": None}, {"started_at": "1"}, {"end_at": True},
    {"cpus": -1}, {"memory_mb": 1.5}, {"sandbox": "../../etc"}, {"sandbox": None},
    {"checkpoint": "sha256:zz"}, {"checkpoint": "sha256:" + "0" * 64},  # both set
    {"memory": "yes"},
])
def test_a_malformed_record_is_skipped(records, change):
    data = {**_record().to_json(), **change}
    (records.path / "i0123456789abcdef012.json").write_text(json.dumps(data))
    assert records.load(10) == []


def test_files_that_are_not_plain_records_are_skipped(records, tmp_path):
    good = _record()
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(good.to_json()))
    (records.path / f"{good.id}.json").symlink_to(outside)  # never followed
    os.mkfifo(records.path / "i1111111111111111111.json")  # never blocks the start
    (records.path / "i2222222222222222222.json").write_bytes(b" " * (MAX_RECORD + 1))
    (records.path / "i3333333333333333333.json").write_text("[" * 100_000)  # deep nesting
    renamed = _record(id="i4444444444444444444")
    (records.path / "i5555555555555555555.json").write_text(json.dumps(renamed.to_json()))
    (records.path / "i6666666666666666666.json").write_bytes(b"\xff\xfe")
    assert records.load(10) == []


def test_at_most_limit_records_are_read(records):
    for n in range(5):
        records.write(_record(id=f"i{n:019x}"))
    assert [r.id for r in records.load(3)] == [f"i{n:019x}" for n in range(3)]


def test_one_server_owns_a_directory(records):
    second = RecordDir(records.path)
    with pytest.raises(SettingsError, match="another envbuild serve"):
        second.claim()
    records.release()
    second.claim()
    second.release()


def test_a_directory_open_to_others_is_refused(tmp_path):
    open_dir = tmp_path / "serve"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(SettingsError, match="not a private directory"):
        RecordDir(open_dir).claim()
    (tmp_path / "link").symlink_to(tmp_path / "other", target_is_directory=True)
    (tmp_path / "other").mkdir(mode=0o700)
    with pytest.raises(SettingsError, match="not a private directory"):
        RecordDir(tmp_path / "link").claim()


def test_a_record_keeps_its_lifecycle_and_an_old_one_gets_kill(records):
    from envbuild.serve.lifecycle import Lifecycle

    policy = Lifecycle(on_timeout="pause", memory=True, auto_resume=True, timeout=30.0)
    records.write(_record(lifecycle=policy))
    assert records.load(10)[0].lifecycle == policy
    data = _record().to_json()
    del data["lifecycle"]  # a record of a server before lifecycles
    (records.path / f"{data['id']}.json").write_text(json.dumps(data))
    assert records.load(10)[0].lifecycle == Lifecycle()


@pytest.mark.parametrize("bad", [{"on_timeout": "hibernate"}, {"auto_resume": "yes"},
                                 {"timeout": -1}, {"extra": 1}])
def test_a_record_with_a_bad_lifecycle_is_skipped(records, bad):
    data = _record().to_json()
    data["lifecycle"] = {**data["lifecycle"], **bad}
    (records.path / f"{data['id']}.json").write_text(json.dumps(data))
    assert records.load(10) == []
