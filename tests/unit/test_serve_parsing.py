"""The pure parsers of ``envbuild serve``: an upload part's file name as sent, the user of an
envd request, a passwd file, and one ``stat -c`` line as E2B's ``EntryInfo``."""

from __future__ import annotations

import base64

import pytest

from envbuild.serve.envd_fs import _entry_info
from envbuild.serve.files import _filename
from envbuild.serve.users import UnknownUser, _parse_passwd, header_user


class _Part:
    def __init__(self, header: str) -> None:
        self.headers = {"Content-Disposition": header}


@pytest.mark.parametrize(("header", "name"), [
    ('form-data; name="file"; filename="/tmp/many/0.txt"', "/tmp/many/0.txt"),  # kept absolute
    ('form-data; name="file"; filename="/a \\"q\\".txt"', '/a "q".txt'),
    ("form-data; name=file; filename=/x/y", "/x/y"),
    ('form-data; name="file"', None),
])
def test_an_upload_keeps_the_file_name_as_sent(header, name):
    assert _filename(_Part(header)) == name


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
