"""``Sandbox.read_stream`` / ``write_stream`` hold the bounds of ``read_file`` /
``write_file`` (``runtime_shim.isolation.fsaccess``): a FIFO or device is never opened (no
blocking), a directory is refused, a symlink the sandbox plants resolves inside its root only
(written through when it names a file there, as ``write_file`` does), files are made where
no symlink can redirect them, and an aborted write removes only the file it made."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.sdk.sandbox import Sandbox
from tests.bounded import run_bounded

pytestmark = pytest.mark.integration


@pytest.fixture
def sandbox(busybox_store):
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        yield sb




def _write(sb: Sandbox, path: str, data: bytes) -> None:
    with sb.write_stream(path) as w:
        w.write(data)


def test_streams_refuse_fifos_devices_and_directories_without_blocking(sandbox):
    assert sandbox.exec("mkfifo /tmp/fifo && ln -s /tmp/fifo /tmp/link-to-fifo").exit_code == 0
    for path in ("/tmp/fifo", "/tmp/link-to-fifo", "/dev/null", "/dev/zero", "/tmp"):
        with pytest.raises(RuntimeShimError, match="not a regular file"):
            run_bounded(lambda p=path: sandbox.read_stream(p))
        with pytest.raises(RuntimeShimError, match="not a regular file"):
            run_bounded(lambda p=path: _write(sandbox, p, b"x"))
    r = sandbox.exec("timeout 1 cat /tmp/fifo; ls -l /tmp/fifo; ls -a /tmp")
    assert r.stdout.startswith(b"p")  # still the FIFO, never opened: no reader saw an "x"
    assert b".envbuild-" not in r.stdout  # the refused writes left nothing


def test_planted_symlinks_resolve_inside_the_sandbox(sandbox, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_bytes(b"host's")
    # to a file of the sandbox: read and written through, as read_file / write_file do
    sandbox.exec("echo hi > /tmp/f && ln -s /tmp/f /tmp/link && ln -s ../../tmp/f /tmp/rel")
    with sandbox.read_stream("/tmp/link") as f:
        assert f.read() == b"hi\n"
    run_bounded(lambda: _write(sandbox, "/tmp/link", b"through"))
    assert sandbox.exec("cat /tmp/f; test -L /tmp/link && echo link").stdout == b"throughlink\n"
    run_bounded(lambda: _write(sandbox, "/tmp/rel", b"relative"))
    assert sandbox.read_file("/tmp/f") == b"relative"
    # to the host's paths: resolved in the sandbox's root, the host's files untouched
    sandbox.exec(f"ln -s {host} /tmp/hostdir && ln -s {host}/secret /tmp/hostfile")
    with pytest.raises(RuntimeShimError):
        sandbox.read_stream("/tmp/hostfile")  # no such file inside the sandbox
    with pytest.raises(RuntimeShimError):
        _write(sandbox, "/tmp/hostfile", b"overwritten?")  # dangling inside: refused
    with pytest.raises(RuntimeShimError, match="No such file"):
        _write(sandbox, "/tmp/hostdir/new", b"outside?")  # no such directory inside
    assert (host / "secret").read_bytes() == b"host's"
    assert sorted(p.name for p in host.iterdir()) == ["secret"]
    sandbox.exec(f"mkdir -p {host}")  # now there is one inside: the write lands there
    run_bounded(lambda: _write(sandbox, "/tmp/hostdir/new", b"inside"))
    assert sandbox.exec(f"cat {host}/new").stdout == b"inside"
    assert sorted(p.name for p in host.iterdir()) == ["secret"]


def test_a_symlink_planted_at_the_target_during_a_write_leads_nowhere(sandbox, tmp_path):
    """The sandbox swaps the target for a symlink to a host path while the write runs: at
    ``commit`` it is resolved inside the root (nothing there: refused), the host's file is
    untouched and the temporary file gone."""
    host = tmp_path / "victim"
    host.write_bytes(b"host's")
    sandbox.write_file("/tmp/swap", b"old")  # an existing target: written at commit
    w = sandbox.write_stream("/tmp/swap")
    w.write(b"mine")
    sandbox.exec(f"rm /tmp/swap && ln -s {host} /tmp/swap")
    with pytest.raises(RuntimeShimError, match="dangling"):
        w.commit()
    assert host.read_bytes() == b"host's"
    assert b".envbuild-" not in sandbox.exec("ls -a /tmp").stdout


def test_an_aborted_new_file_goes_but_not_a_file_the_sandbox_put_in_its_place(sandbox):
    w = sandbox.write_stream("/tmp/new-one")
    w.write(b"half")
    assert sandbox.read_file("/tmp/new-one") == b"half"  # a new file is written in place
    w.abort()
    assert b"new-one" not in sandbox.exec("ls -a /tmp").stdout
    w = sandbox.write_stream("/tmp/new-two")
    w.write(b"half")
    sandbox.exec("rm /tmp/new-two && echo theirs > /tmp/new-two")
    w.abort()
    assert sandbox.read_file("/tmp/new-two") == b"theirs\n"
