"""``/files`` of ``envbuild serve`` streams (issue 37, file throughput): a file much larger
than the server should hold goes up and down through the real ``e2b`` SDK while the server's
memory stays about flat; a file over ``read_file``'s 256 MiB cap downloads; the temporary
file of a refused upload is gone; a FIFO is refused at once. Real runc sandboxes."""

from __future__ import annotations

import hashlib
import os

import pytest

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"
MIB = 1 << 20


def _kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def sandbox(e2b_server):
    from e2b import Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=300)
    yield sb
    sb.kill()


def test_a_large_upload_and_download_keep_the_server_small(e2b_server, sandbox, tmp_path):
    pid = e2b_server.proc.pid
    src = tmp_path / "big"
    with open(src, "wb") as f:  # 192 MiB, not all zeros (so nothing can be sparse on the way)
        for i in range(192):
            f.write(bytes([i]) * MIB)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from now
    before = _kib(pid, "VmRSS")
    with open(src, "rb") as f:
        sandbox.files.write("/tmp/big", f)  # httpx streams a binary file in the multipart body
    down = hashlib.md5()
    for chunk in sandbox.files.read("/tmp/big", format="stream"):
        down.update(chunk)
    grown = (_kib(pid, "VmHWM") - before) * 1024
    assert grown < 48 * MIB, f"the server grew by {grown >> 20} MiB for a 192 MiB file"
    want = hashlib.md5(src.read_bytes()).hexdigest()
    assert down.hexdigest() == want
    assert sandbox.commands.run("md5sum < /tmp/big").stdout.split()[0] == want


def test_a_file_over_read_files_cap_downloads(sandbox):
    sandbox.commands.run("dd if=/dev/zero of=/tmp/huge bs=1 count=1 seek=300M 2>/dev/null",
                         user="root")
    got = sum(len(c) for c in sandbox.files.read("/tmp/huge", format="stream"))
    assert got == (300 << 20) + 1


def test_an_empty_file_downloads_as_empty(sandbox):
    """A file of 0 bytes reads as b"" (``sendfile`` refuses a count of 0: the server raised
    after sending its headers, and the client got a broken response)."""
    sandbox.commands.run(": > /tmp/empty")
    assert sandbox.files.read("/tmp/empty", format="bytes") == bytearray()
    assert sandbox.files.read("/tmp/empty") == ""


def test_a_refused_upload_leaves_nothing_and_fifos_are_refused(e2b_server, sandbox):
    import httpx
    from e2b import SandboxException

    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id,
            "X-Access-Token": sandbox._envd_access_token}
    boundary = "b0"

    def body():  # a chunked multipart body that breaks off before its part ends
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
               f"filename=\"cut\"\r\n\r\n").encode()
        yield os.urandom(3 * MIB)

    with pytest.raises(httpx.HTTPError):
        r = httpx.post(f"{e2b_server.url}/files", params={"path": "/tmp/cut"}, headers={
            **envd, "Content-Type": f"multipart/form-data; boundary={boundary}"},
            content=body())
        r.raise_for_status()
    listing = sandbox.commands.run("ls -a /tmp").stdout
    assert "cut" not in listing, listing  # neither the file nor its temporary one
    sandbox.commands.run("mkfifo /tmp/fifo", user="root")
    with pytest.raises(SandboxException, match="not a regular file"):
        sandbox.files.read("/tmp/fifo")


def test_an_existing_file_is_overwritten_whole_or_not_at_all(e2b_server, sandbox):
    """An upload over an existing file is gathered in the server's reused buffer and written
    into the file at its end (the same inode): multipart and octet-stream; a gzip body that
    grows past its Content-Length goes on streamed; a body broken at its end leaves the old
    bytes."""
    import gzip

    import httpx

    sandbox.commands.run("echo old > /tmp/ex")
    inode = sandbox.commands.run("stat -c %i /tmp/ex").stdout
    for octet in (False, True, False):
        data = os.urandom(3 * MIB + 5)
        sandbox.files.write("/tmp/ex", data, use_octet_stream=octet)
        assert bytes(sandbox.files.read("/tmp/ex", format="bytes")) == data
    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id,
            "X-Access-Token": sandbox._envd_access_token}
    text = b"grows " * (2 * MIB)  # 12 MiB from a few KiB on the wire
    r = httpx.post(f"{e2b_server.url}/files", params={"path": "/tmp/ex"},
                   content=gzip.compress(text), headers={
                       **envd, "Content-Type": "application/octet-stream",
                       "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    assert bytes(sandbox.files.read("/tmp/ex", format="bytes")) == text
    cut = (b'--b0\r\nContent-Disposition: form-data; name="file"; filename="/tmp/ex"\r\n\r\n'
           + os.urandom(2 * MIB))  # no closing boundary
    r = httpx.post(f"{e2b_server.url}/files", content=cut, headers={
        **envd, "Content-Type": "multipart/form-data; boundary=b0"})
    assert r.status_code == 400, r.text
    assert bytes(sandbox.files.read("/tmp/ex", format="bytes")) == text
    assert sandbox.commands.run("stat -c %i /tmp/ex").stdout == inode
    assert sandbox.commands.run("ls -a /tmp").stdout.split().count("ex") == 1


def test_octet_stream_uploads_iterables_and_gzip(sandbox):
    """envd 0.5.7: the SDK sends an iterable or a file object as the raw body, gzipped on
    request."""
    pieces = [os.urandom(300 << 10) for _ in range(7)]
    info = sandbox.files.write("/tmp/it/pieces.bin", iter(pieces))
    assert info.path == "/tmp/it/pieces.bin"
    assert bytes(sandbox.files.read("/tmp/it/pieces.bin", format="bytes")) == b"".join(pieces)
    text = "gzipped " * 100_000
    sandbox.files.write("/tmp/it/z.txt", text, gzip=True, use_octet_stream=True)
    assert sandbox.files.read("/tmp/it/z.txt") == text
    sandbox.files.write("/tmp/it/agent.txt", iter([b"as agent"]), user="agent")
    assert sandbox.files.get_info("/tmp/it/agent.txt").owner == "agent"


def test_a_gzip_bomb_is_cut_at_the_upload_bound(e2b_built, tmp_path):
    import gzip

    import httpx

    from tests.e2b_server import e2b_env, running_server

    _, store, _ = e2b_built
    with running_server(tmp_path, store.root, tmp_path / "node",
                        args=("--max-upload", "1MiB")) as srv, \
            e2b_env(srv):
        from e2b import Sandbox

        sb = Sandbox.create(TEMPLATE, timeout=60)
        try:
            bomb = gzip.compress(b"\0" * (64 * MIB))  # ~64 KiB on the wire
            r = httpx.post(f"{srv.url}/files", params={"path": "/tmp/bomb"}, content=bomb,
                           headers={"E2b-Sandbox-Id": sb.sandbox_id,
                                    "X-Access-Token": sb._envd_access_token,
                                    "Content-Type": "application/octet-stream",
                                    "Content-Encoding": "gzip"})
            assert r.status_code == 413, r.text
            assert "bomb" not in sb.commands.run("ls -a /tmp").stdout
            broken = httpx.post(f"{srv.url}/files", params={"path": "/tmp/broken"},
                                content=b"not gzip at all", headers={
                                    "E2b-Sandbox-Id": sb.sandbox_id,
                                    "X-Access-Token": sb._envd_access_token,
                                    "Content-Type": "application/octet-stream",
                                    "Content-Encoding": "gzip"})
            assert broken.status_code == 400, broken.text
            assert "broken" not in sb.commands.run("ls -a /tmp").stdout
        finally:
            sb.kill()
