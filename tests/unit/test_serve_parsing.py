"""The pure parsers of ``envbuild serve``: an upload part's file name as sent, the user of an
envd request, a passwd file, and one ``stat -c`` line as E2B's ``EntryInfo``."""

from __future__ import annotations

import base64

import pytest

from envbuild.serve.envd_fs import _components, _entry_info
from envbuild.serve.files import HoldBudget, _filename
from envbuild.serve.users import UnknownUser, _parse_passwd, header_user


@pytest.mark.parametrize(("header", "name"), [
    ('form-data; name="file"; filename="/tmp/many/0.txt"', "/tmp/many/0.txt"),  # kept absolute
    ('form-data; name="file"; filename="/a \\"q\\".txt"', '/a "q".txt'),
    ("form-data; name=file; filename=/x/y", "/x/y"),
    ('form-data; name="file"', None),
])
def test_an_upload_keeps_the_file_name_as_sent(header, name):
    assert _filename(header) == name


def test_the_user_of_a_request():
    def basic(raw: str) -> str:
        return "Basic " + base64.b64encode(raw.encode()).decode()

    assert header_user(basic("agent:")) == "agent"
    assert header_user(None) is None and header_user(basic(":")) is None
    with pytest.raises(UnknownUser):
        header_user("Basic !!!")


def test_passwd_by_name_and_uid():
    users = _parse_passwd("root:x:0:0:root:/root:/bin/sh\nbad line\nagent:x:1000:1001::/home/a:")
    assert users["agent"] == ("1000:1001", "/home/a") and users["#0"] == ("0:0", "/root")
    assert "bad line" not in users


def test_a_stat_line_is_an_entry_info():
    from e2b.envd.filesystem import filesystem_pb as pb

    e = _entry_info("81a4|5|root|root|1700000000|/tmp/x|y")
    assert (e.name, e.path, e.type, e.size, e.mode) == ("x|y", "/tmp/x|y", pb.FileType.FILE, 5,
                                                        0o644)
    assert e.permissions == "-rw-r--r--" and e.modified_time.seconds == 1700000000
    link = _entry_info("a1ff|7|root|root|0|/bin/sh")
    assert link.is_symlink and link.type == pb.FileType.SYMLINK and link.name == "sh"


def test_a_symlinks_stat_is_its_targets_type_with_the_resolved_target():
    """E2B's ``Stat`` of a symlink: type and mode of the target, ``symlink_target`` its
    resolved path, ``is_symlink`` set (E2B's own test_file_symlink)."""
    from e2b.envd.filesystem import filesystem_pb as pb

    e = _entry_info("a1ff|8|user|user|0|/home/user/l", "81a4|/home/user/d/t.txt")
    assert (e.type, e.mode, e.symlink_target) == (pb.FileType.FILE, 0o644, "/home/user/d/t.txt")
    assert e.is_symlink and e.size == 8
    dangling = _entry_info("a1ff|4|user|user|0|/home/user/l", "0|/home/user/gone")
    assert dangling.type == pb.FileType.UNSPECIFIED and dangling.symlink_target


def test_listings_are_in_e2bs_order():
    """Each directory's entries by name, a directory right before its contents (E2B's
    ``ListDir`` walks so; its test_list_directory checks the order)."""
    lines = [f"41ed|0|u|u|0|/d/{p}" for p in ("sub2", "sub1/b", "file1.txt", "sub1", "sub1/a",
                                             "sub2/c")]
    assert [ln.rsplit("/d/", 1)[1] for ln in sorted(lines, key=_components)] == [
        "file1.txt", "sub1", "sub1/a", "sub1/b", "sub2", "sub2/c"]


def _entry(sid: str, started: float, template: str = "t", **metadata: str):
    from envbuild.serve.sandboxes import Entry

    return Entry(id=sid, template=template, sandbox=None, token="", metadata=metadata,
                 env_vars={}, started_at=started, end_at=started + 60)


def test_list_pages_filters_and_order():
    from envbuild.serve.control import ListQuery

    entries = [_entry("a", 1.0, k="x"), _entry("b", 2.0, k="x"), _entry("c", 3.0, "u", k="y")]
    q = ListQuery.from_params({"limit": "1"})
    page, token = q.page(entries)
    assert [e.id for e in page] == ["c"] and token == "1"  # newest first
    page, token = ListQuery.from_params({"limit": "2", "nextToken": token}).page(entries)
    assert [e.id for e in page] == ["b", "a"] and token is None
    asc = ListQuery.from_params({"order": "asc", "metadata": "k=x"}).page(entries)[0]
    assert [e.id for e in asc] == ["a", "b"]
    assert [e.id for e in ListQuery.from_params({"template": "u"}).page(entries)[0]] == ["c"]
    after = ListQuery.from_params({"startedAfter": "1970-01-01T00:00:02Z"}).page(entries)[0]
    assert [e.id for e in after] == ["c", "b"]
    assert ListQuery.from_params({"state": "paused"}).page(entries)[0] == []


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "101"}, {"nextToken": "x"},
                                    {"startedAfter": "yesterday"}])
def test_a_bad_list_query_is_a_400(params):
    from aiohttp import web

    from envbuild.serve.control import ListQuery

    with pytest.raises(web.HTTPBadRequest):
        ListQuery.from_params(params)


def test_users_resolve_against_the_sandbox_passwd_once():
    import asyncio
    import types

    from envbuild.serve.users import User, resolve

    reads = []

    async def read_file(path):
        reads.append(path)
        return b"root:x:0:0::/root:/bin/sh\npasswd:x:7:8::/var/p:/bin/sh\nagent:x:1000:1000::/home/agent:"

    entry = _entry("a", 1.0)
    entry.sandbox = types.SimpleNamespace(read_file=read_file,
                                          lock=types.SimpleNamespace(user="1000:1000"))

    async def main():
        return [await resolve(entry, n) for n in (None, "passwd", "agent", "root")]

    assert asyncio.run(main()) == [User("1000:1000", "/home/agent"),
                                   User("7:8", "/var/p", named=True),
                                   User("1000:1000", "/home/agent", named=True),
                                   User("0:0", "/root", named=True)]
    assert reads == ["/etc/passwd"]
    with pytest.raises(UnknownUser):
        asyncio.run(resolve(entry, "nobody"))


def test_a_reported_start_time_filters_as_itself():
    """startedAfter=<a sandbox's reported startedAt> keeps that sandbox: the time it is stored
    with is whole microseconds, as reported, so the round trip through ISO 8601 is exact."""
    import datetime

    from envbuild.serve.control import ListQuery, _iso

    for _ in range(2000):
        now = datetime.datetime.now(datetime.UTC).timestamp()
        e = _entry("a", now)
        assert ListQuery.from_params({"startedAfter": _iso(now)}).page([e])[0] == [e]


def test_the_hold_budget_gives_whole_uploads_while_it_has_room():
    budget = HoldBudget(total=10, one=4)
    assert [budget.take(n) for n in (None, 0, 5, 4, 4)] == [0, 0, 0, 4, 4]
    assert budget.take(3) == 0 and budget.free == 2  # 2 left: a 3-byte upload streams
    budget.give(4)
    assert budget.take(3) == 3 and budget.free == 3


def test_the_hold_budget_reuses_warm_buffers_and_keeps_few_idle():
    """An upload's bytes are gathered in a buffer that is reused (fresh memory for each
    upload cost ~5 ms of page faults per 10 MiB); at most ``2 * one`` stays idle."""
    mib = 1 << 20
    budget = HoldBudget(total=64 * mib, one=4 * mib)
    a = budget.buffer(3 * mib + 1)
    assert len(a) == 4 * mib  # whole MiB
    budget.keep(a)
    assert budget.buffer(2 * mib) is a  # the idle one that fits, not a new one
    b, c = budget.buffer(mib), budget.buffer(2 * mib)
    assert len(b) == mib and len(c) == 2 * mib
    for buf in (a, b, c):
        budget.keep(buf)  # 7 MiB idle: within 8
    assert budget.buffer(mib) is b  # the smallest that fits
    budget.keep(b)
    budget.keep(bytearray(2 * mib))  # 9 MiB: the oldest idle one (a) is freed
    assert [len(x) for x in budget.idle] == [2 * mib, mib, 2 * mib]
    assert not any(x is a for x in budget.idle)
