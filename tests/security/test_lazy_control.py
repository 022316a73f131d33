"""The lazy layer daemon's control channel (``runtime_shim.lazyfs.control``) against the local
users of a node. The daemon runs as root and mounts FUSE filesystems: whoever can tell it where
to mount what is root (issue 34, item 1). Observed before the fix, with the socket in the
abstract namespace under a name anyone could compute:

- an unprivileged process asked it to mount that user's store over a root-only directory;
- an unprivileged process that bound the name first received every lazy create's requests and
  answered ``meta`` with ``<node>/meta/<hex>/../../…/usr``, which the client accepted;
- and, the first review's bomb: an endless request line buffered whole.

Each test runs the real daemon (``python -m runtime_shim.lazyfs --node``) or the real client
(``NodeCache.ensure_lazy``, ``meta_dirs``); the attacker is a real process running as uid 65534
(Debian's ``/usr/bin/python3``, stdlib only: it has none of envbuild)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from envbuild.layers import pack_tree
from envbuild.store import open_store, put_file
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs.control import (
    MAX_MESSAGE,
    ControlListener,
    daemon_request,
    private_dir,
    socket_path,
)
from runtime_shim.lazyfs.metalayer import meta_dirs
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool
from tests.lazy_daemon import bare_daemon

FLOOD = 3 * MAX_MESSAGE  # 96 MiB without a newline
NOBODY = 65534
ATTACKER_PYTHON = "/usr/bin/python3"

# The attacker: connect to the daemon by every name it ever had (the node's socket file, and
# the abstract name the daemon used to bind, sha256 of the node path) and send one request;
# print what happened as one JSON line.
ATTACK = r"""
import hashlib, json, socket, sys
node, request = sys.argv[1], sys.argv[2]
names = [node + "/run/lazyfs.sock",
         b"\0envbuild-lazyfs-" + hashlib.sha256(node.encode()).hexdigest()[:32].encode()]
out = []
for name in names:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    try:
        s.connect(name)
        s.sendall(request.encode() + b"\n")
        out.append({"name": repr(name), "reply": s.recv(1 << 16).decode(errors="replace")})
    except OSError as e:
        out.append({"name": repr(name), "error": e.strerror or str(e)})
    finally:
        s.close()
print(json.dumps(out))
"""


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _connect(node: Path) -> socket.socket:
    fd = private_dir(node, create=False)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path(fd))
    finally:
        os.close(fd)
    return sock


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may traverse (0755, like ``/var/lib``), so that only the node's
    own protections stand between an unprivileged user and the daemon (pytest's tmp dirs are
    0700 and would hide a hole)."""
    require_root()
    d = Path(tempfile.mkdtemp(prefix="envbuild-sec-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


@pytest.fixture
def attacker_layer(open_dir) -> tuple[str, str, str]:
    """A store the unprivileged user owns, holding a layer of theirs: ``(store dir, digest,
    toc digest)``."""
    tree = open_dir / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "shadow").write_text("root::0:0:99999:7:::\n")   # an empty root password
    store_dir = open_dir / "attacker-store"
    store = open_store(str(store_dir))
    blob = open_dir / "layer.blob"
    with open(blob, "wb") as out:
        info = pack_tree(tree, out)
    put_file(store, blob)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(store_dir)], check=True)
    return str(store_dir), info.digest, info.toc_digest


def _attack(node: Path, request: dict) -> list[dict]:
    require_tool(ATTACKER_PYTHON)
    proc = subprocess.run([ATTACKER_PYTHON, "-c", ATTACK, str(node), json.dumps(request)],
                          user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                          capture_output=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def _victim(open_dir: Path) -> Path:
    """A root-only directory (as ``/etc`` is root's) with a file in it."""
    victim = open_dir / "victim"
    victim.mkdir(mode=0o700)
    (victim / "secret").write_text("root's\n")
    return victim


@pytest.fixture
def mount_over_victim(open_dir, attacker_layer) -> tuple[Path, Path, dict]:
    """``(node, victim, request)``: a node dir every user may traverse (0755), a root-only dir,
    and the request that mounts the unprivileged user's layer over it."""
    require_tool("fusermount3")
    store_dir, digest, toc = attacker_layer
    node = open_dir / "node"
    node.mkdir(mode=0o755)
    victim = _victim(open_dir)
    return node, victim, {"op": "mount", "mountpoint": str(victim), "store": store_dir,
                          "digest": digest, "toc_digest": toc, "timeout": 20}


def test_an_unprivileged_user_cannot_make_the_daemon_mount(open_dir, mount_over_victim):
    node, victim, request = mount_over_victim
    with bare_daemon(node):
        tries = _attack(node, request)
        assert str(victim) not in mounted_targets_under(str(open_dir)), tries
        assert (victim / "secret").read_text() == "root's\n"
        assert not any('"ok": true' in t.get("reply", "") for t in tries), tries
        # and its own socket is out of reach: the dir is root's, mode 0700
        assert any(t.get("error") == "Permission denied" for t in tries), tries


def test_the_daemon_refuses_other_users_even_through_an_opened_up_socket(open_dir,
                                                                         mount_over_victim):
    """Defence in depth: with the node's private dir and the socket opened to everyone by
    mistake, the daemon still serves no peer but root (``SO_PEERCRED``)."""
    node, victim, request = mount_over_victim
    with bare_daemon(node) as daemon:
        (node / "run").chmod(0o755)
        (node / "run" / "lazyfs.sock").chmod(0o666)
        tries = _attack(node, request)
        reply = tries[0].get("reply", "")
        assert reply, tries   # it connected: only the daemon's own check stands
        assert json.loads(reply) == {"ok": False, "error": f"permission denied: uid {NOBODY} "
                                                           "may not use this daemon"}
        assert str(victim) not in mounted_targets_under(str(open_dir))
        pong = daemon_request(node, {"op": "ping"}, 5)
        assert pong is not None and pong["pid"] == daemon.pid   # root is still served


def test_the_daemon_mounts_only_at_its_own_path_for_the_digest(open_dir, attacker_layer):
    """Even root's request cannot point the daemon elsewhere: ``<node>/lazy/<hex>`` only."""
    require_tool("fusermount3")
    store_dir, digest, toc = attacker_layer
    node = open_dir / "node"
    node.mkdir(mode=0o700)
    victim = _victim(open_dir)
    elsewhere = node / "lazy" / ("0" * 64)
    elsewhere.mkdir(parents=True)
    with bare_daemon(node):
        for mp in (victim, elsewhere, node / "lazy" / digest[7:] / ".." / digest[7:]):
            reply = daemon_request(node, {"op": "mount", "mountpoint": str(mp),
                                          "store": store_dir, "digest": digest,
                                          "toc_digest": toc, "timeout": 20}, 30)
            assert reply is not None and reply["ok"] is False, reply
            assert "only at" in reply["error"], reply
        assert mounted_targets_under(str(open_dir)) == []


def test_a_squatter_on_the_old_name_or_the_node_gets_nothing(open_dir, attacker_layer):
    """An unprivileged user binds every name it can before the node's first lazy create; the
    create starts the real daemon, mounts the real layer, and the squatter hears nothing."""
    require_tool("fusermount3")
    store_dir, digest, toc = attacker_layer
    node = open_dir / "node"   # the node cache's root (NodeCache makes it 0700)
    heard = open_dir / "heard"
    heard.touch()
    heard.chmod(0o666)
    squat = r"""
import hashlib, socket, sys, threading
node, heard = sys.argv[1], sys.argv[2]
name = b"\0envbuild-lazyfs-" + hashlib.sha256(node.encode()).hexdigest()[:32].encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(name)
s.listen(16)
print("bound", flush=True)
while True:
    c, _ = s.accept()
    open(heard, "a").write(c.recv(1 << 16).decode(errors="replace"))
    c.sendall(b'{"ok": true, "pid": 1, "mode": "fuse"}\n')
    c.close()
"""
    squatter = subprocess.Popen([ATTACKER_PYTHON, "-c", squat, str(node), str(heard)],
                                user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                                stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"})
    cache = NodeCache(node)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == b"bound\n"
        mp = cache.ensure_lazy(store_dir, digest, toc)
        assert (mp / "etc" / "shadow").read_text() == "root::0:0:99999:7:::\n"
        assert heard.read_text() == "", "the squatter received the node's requests"
    finally:
        squatter.kill()
        squatter.wait()
        cache.unmount_lazy(keep=())
    assert mounted_targets_under(str(open_dir)) == []


def test_a_socket_served_by_another_user_is_never_sent_a_request(open_dir):
    """The client checks whom it talks to (``SO_PEERCRED``): a socket in the node's dir bound
    by uid 65534 (planted there by a mistake of root's) gets no request; the error says so."""
    node = open_dir / "node"
    (node / "run").mkdir(parents=True, mode=0o700)
    theirs = open_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    heard = theirs / "heard"
    listen = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1] + "/lazyfs.sock")
s.listen(4)
print("bound", flush=True)
c, _ = s.accept()
open(sys.argv[1] + "/heard", "w").write(c.recv(1 << 16).decode(errors="replace"))
"""
    squatter = subprocess.Popen([ATTACKER_PYTHON, "-c", listen, str(theirs)], user=NOBODY,
                                group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin"})
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == b"bound\n"
        os.rename(theirs / "lazyfs.sock", node / "run" / "lazyfs.sock")
        with pytest.raises(RuntimeShimError, match=f"served by uid {NOBODY}"):
            daemon_request(node, {"op": "ping"}, 5)
        squatter.wait(10)   # it accepted, then read EOF: nothing was sent
        assert heard.read_text() == ""
    finally:
        squatter.kill()
        squatter.wait()


def test_a_node_dir_others_can_write_is_refused(open_dir):
    node = open_dir / "node"
    node.mkdir()
    node.chmod(0o777)
    with pytest.raises(RuntimeShimError, match="not private"):
        daemon_request(node, {"op": "ping"}, 5)
    daemon = subprocess.run([sys.executable, "-m", "runtime_shim.lazyfs", "--node", str(node)],
                            capture_output=True, timeout=60, cwd="/",
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert daemon.returncode == 1
    assert b"not private" in daemon.stderr and b"Traceback" not in daemon.stderr
    assert not (node / "run" / "lazyfs.sock").exists()


class _LyingDaemon:
    """A daemon (root: this test process) that answers with what a compromised or buggy one
    might: ``meta`` with a path that climbs out of the node, ``mount`` with a claim of a
    mount that is not there."""

    def __init__(self, node: Path, meta_dir: str) -> None:
        listener = ControlListener.open(node)
        assert listener is not None
        self.listener, self.meta_dir = listener, meta_dir
        self.listener.sock.settimeout(0.1)
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _uid = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                req = json.loads(conn.recv(1 << 20))
                if req["op"] == "meta":
                    reply = {"ok": True, "layers": [{"digest": x["digest"], "dir": self.meta_dir}
                                                    for x in req["layers"]]}
                else:
                    reply = {"ok": True, "pid": 1, "mode": "passthrough"}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("claim", ["{meta}/../../../usr", "{meta}/g-0123456789abcdef/../../..",
                                   "{meta}/g-0123456789abcdef/mnt",   # the right shape, no mount
                                   "/usr", "{meta}x/g-0123456789abcdef/mnt"])
def test_a_meta_dir_reply_is_checked_against_its_exact_pattern(tmp_path, claim):
    require_root()
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    digest = "sha256:" + hashlib.sha256(b"layer").hexdigest()
    meta = node / "meta" / digest[7:]
    (meta / "g-0123456789abcdef" / "mnt").mkdir(parents=True)
    liar = _LyingDaemon(node, claim.format(meta=meta))
    try:
        assert meta_dirs(node, [(digest, str(node / "lazy" / digest[7:]))]) == [""]
    finally:
        liar.close()


def test_a_claimed_mount_that_is_not_there_is_an_error(tmp_path):
    require_root()
    node = tmp_path / "node"
    cache = NodeCache(node)
    digest = "sha256:" + hashlib.sha256(b"layer").hexdigest()
    liar = _LyingDaemon(node, "")
    try:
        with pytest.raises(RuntimeShimError, match="nothing is"):
            cache.ensure_lazy(str(tmp_path / "store"), digest, None)
    finally:
        liar.close()
    assert not (node / "lazy" / f"{digest[7:]}.json").exists()


def test_an_endless_request_line_is_refused_with_bounded_memory(tmp_path):
    node = tmp_path / "node"
    with bare_daemon(node) as daemon:
        before = _hwm_mib(daemon.pid)
        # keep the daemon from exiting idle while we flood: a second, silent connection
        keeper = _connect(node)
        sock = _connect(node)
        sock.settimeout(30)
        chunk = b"x" * (1 << 20)
        sent, t0 = 0, time.monotonic()
        try:
            while sent < FLOOD:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we were done: the point
        reply = b""
        try:
            reply = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            pass
        sock.close()
        elapsed = time.monotonic() - t0
        assert sent < FLOOD, "the daemon read the whole flood"
        if reply:
            msg = json.loads(reply)
            assert msg["ok"] is False and "longer than" in msg["error"]
        assert elapsed < 20
        assert _hwm_mib(daemon.pid) - before < 100, "the daemon buffered the flood"
        pong = daemon_request(node, {"op": "ping"}, 5)
        assert pong is not None and pong["pid"] == daemon.pid
        keeper.close()
