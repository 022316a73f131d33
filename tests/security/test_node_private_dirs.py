"""What a node keeps from its other local users (issue 34, item 1's review of every socket a
node opens): a sandbox's dir holds its writable layer (the agent's work, and a grading sandbox's
hidden tests), the agent's socket and, for a microVM, QEMU's monitor (QMP: ``migrate`` to
``exec:`` runs a command as root). Before the fix ``<node dir>/sandboxes`` was made 0755, so any
user could read a running sandbox's files; now it is the node's only (0700).

The sandbox is a real runc container; the other user is a real process as uid 65534, with the
node dir inside a directory every user may traverse (as ``/var/lib`` is)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool

NOBODY = 65534
PROBE = r"""
import json, os, socket, sys
out = {}
for name, path in (("list", sys.argv[1]), ("read", sys.argv[2])):
    try:
        out[name] = os.listdir(path) if name == "list" else open(path).read()
    except OSError as e:
        out[name] = "error: " + (e.strerror or "")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[3])
    out["connect"] = "connected"
except OSError as e:
    out["connect"] = "error: " + (e.strerror or "")
print(json.dumps(out))
"""


@pytest.fixture
def open_node(busybox_store) -> Iterator[Path]:
    require_root()
    d = Path(tempfile.mkdtemp(prefix="envbuild-sec-"))
    d.chmod(0o755)
    yield d / "nodedir"
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


def test_another_user_cannot_enter_a_running_sandbox_dir(busybox_store, open_node):
    require_tool("/usr/bin/python3")
    store, _ = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=open_node) as sb:
        r = sb.exec("echo agent-work > /answer.txt && chmod 644 /answer.txt")
        assert r.exit_code == 0, r.stderr
        # the root is mounted only in the sandbox's own mount namespace; on the host its
        # writes are in the upper dir (what pack-diff and grading read)
        upper = sb.paths.upper
        assert (upper / "answer.txt").read_text() == "agent-work\n"
        probe = subprocess.run(
            ["/usr/bin/python3", "-c", PROBE, str(upper),
             str(upper / "answer.txt"), str(sb.paths.agent_socket)],
            user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True,
            timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert probe.returncode == 0, probe.stderr.decode()
        seen = json.loads(probe.stdout)
        assert seen == {"list": "error: Permission denied", "read": "error: Permission denied",
                        "connect": "error: Permission denied"}, seen
    assert (open_node / "sandboxes").stat().st_mode & 0o777 == 0o700
