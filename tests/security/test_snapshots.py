"""Snapshots (pack-diff) and sandbox removal against what an agent can make inside a real runc
sandbox: a 4,096-deep tree (issue 11 item 7), files named like OCI whiteouts and overlay
xattrs it sets itself (item 12), and ``envbuild sandbox gc`` over orphans of which one cannot
be removed ("Done when": clean what it can, report the rest per sandbox)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from envbuild.errors import LayerError
from envbuild.safefs import iter_tree, remove_tree
from runtime_shim.node.packdiff import SnapshotRefused
from runtime_shim.sdk.sandbox import Sandbox, SandboxPaths, list_sandboxes, remove_sandbox
from tests.conftest import REPO, require_root, require_tool

ENV = "env/busybox-shell"
# the issue's loop, verbatim. busybox's logical ``cd d`` builds "$PWD/d", so it stops at
# PATH_MAX (~2,045 levels, 4 KB paths); the probe below (mkdir + chdir of the relative name,
# as any program can) makes the full 4,096 levels (8 KB paths)
ISSUE_LOOP = "i=0; while [ $i -lt 4096 ]; do mkdir d; cd d; i=$((i+1)); done"

PROBE_C = r"""
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>
/* probe setxattr NAME PATH: set NAME=y, print "ok" or the errno name
   probe mkdeep N DIR:      DIR/d/d/... N levels deep, a file f at the bottom */
int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "setxattr")) {
        if (setxattr(argv[3], argv[2], "y", 1, 0) == 0) { puts("ok"); return 0; }
        puts(errno == EPERM ? "EPERM" : strerror(errno));
        return 1;
    }
    if (argc == 4 && !strcmp(argv[1], "mkdeep")) {
        if (chdir(argv[3])) { perror("chdir"); return 1; }
        for (int i = atoi(argv[2]); i > 0; i--)
            if (mkdir("d", 0755) || chdir("d")) { perror("mkdir d"); return 1; }
        FILE *f = fopen("f", "w");
        if (!f || fputs("bottom\n", f) < 0 || fclose(f)) { perror("f"); return 1; }
        puts("ok");
        return 0;
    }
    return 2;
}
"""


def _probe(tmp_path: Path) -> bytes:
    """A static binary the sandbox runs (busybox has no setfattr)."""
    gcc = require_tool("gcc")
    (tmp_path / "probe.c").write_text(PROBE_C)
    subprocess.run([gcc, "-static", "-O1", "-o", str(tmp_path / "probe"),
                    str(tmp_path / "probe.c")], check=True, capture_output=True)
    return (tmp_path / "probe").read_bytes()


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> bytes:
    return _probe(tmp_path_factory.mktemp("probe"))


def _sandbox(busybox_store, node=None) -> Sandbox:
    store, node_dir = busybox_store
    return Sandbox.create(ENV, store=store, node_dir=node or node_dir)


def _make_deep(sb: Sandbox, probe: bytes) -> None:
    sb.write_file("/probe", probe, mode=0o755)
    r = sb.exec("mkdir /workspace/deep && /probe mkdeep 4096 /workspace/deep && rm /probe")
    assert r.exit_code == 0, r.stderr
    # the attack happened: 4,096 levels in the upper dir that pack-diff and close() read
    assert _depth(sb.handle.upper_dir() / "workspace" / "deep") == 4096


def _depth(path: Path) -> int:
    """Directories below ``path`` on the way to its deepest entry (fd-based: any depth)."""
    return max(len(parts) for parts, _fd, _e in iter_tree(path))


def test_a_4096_deep_tree_refuses_the_snapshot_in_one_line_and_close_removes_it(busybox_store,
                                                                              probe):
    store, node = busybox_store
    sb = _sandbox(busybox_store)
    root = sb.paths.root
    try:
        r = sb.exec(f"cd /workspace && {ISSUE_LOOP}", timeout=120)
        assert b"File name too long" in r.stderr  # busybox stopped at PATH_MAX ...
        _make_deep(sb, probe)  # ... the probe goes on to 4,096
        with pytest.raises(SnapshotRefused) as err:
            sb.pack_diff(publish="snap/deep")
        message = str(err.value)
        assert "\n" not in message and "path workspace/deep/d/d/d/" in message, message
        assert "4095-byte limit" in message, message
        assert "snap/deep" not in store.list_refs()  # nothing published
    finally:
        sb.close()
    assert not root.exists()  # the whole 4,096-deep tree went with it
    assert sb.id not in {i.id for i in list_sandboxes(node)}


def test_a_snapshot_whose_toc_no_reader_takes_is_refused_and_not_published(busybox_store):
    """22,000 empty files under a 3.4 KB path give a TOC of ~75 MB, over the readers' 64 MiB
    (``envbuild.layers._toc.MAX_TOC_USIZE``): the writer refuses it in one line naming that
    limit and nothing is published (before: published, then no restore could open it)."""
    store, _ = busybox_store
    deep = "/workspace/" + "/".join(["n" * 240] * 14)
    with _sandbox(busybox_store) as sb:
        r = sb.exec(f"mkdir -p {deep} && cd {deep} && seq 1 22000 | xargs touch", timeout=300)
        assert r.exit_code == 0, r.stderr
        with pytest.raises(LayerError) as err:
            sb.pack_diff(publish="snap/huge-toc")
    message = str(err.value)
    assert "\n" not in message and "exceeds the reader limit of 64 MiB" in message, message
    assert "snap/huge-toc" not in store.list_refs()


LOOK_ALIKES = r"""
set -e
cd /workspace
echo agent > /etc/.wh.passwd                 # a file named like the whiteout of /etc/passwd
touch tests/.wh..wh..opq                     # like the opaque marker of tests/
mkdir .wh.bin && echo x > .wh.bin/inside     # a directory named like the whiteout of bin/
ln -s nowhere .wh.README.md                  # a symlink named like the whiteout of README.md
"""


def _tree(sb: Sandbox, *paths: str) -> str:
    """Names below each dir of ``paths`` and each file's checksum (or the error)."""
    script = ('for p in "$@"; do echo "== $p"; if [ -d "$p" ]; then ls -1a "$p"; '
              'else md5sum "$p" 2>&1; fi; done')
    r = sb.exec(["/bin/sh", "-c", script, "sh", *paths])
    return r.stdout.decode()


def test_whiteout_look_alikes_and_agent_overlay_xattrs_never_delete_on_restore(busybox_store,
                                                                              probe):
    store, node = busybox_store
    with _sandbox(busybox_store) as a:
        lower = _tree(a, "/etc/passwd", "/workspace/tests", "/workspace/bin",
                      "/workspace/README.md", "/workspace/lib")
        assert "test_list.sh" in lower and "kv.sh" in lower and "kv" in lower
        assert a.exec(LOOK_ALIKES).exit_code == 0
        a.write_file("/probe", probe, mode=0o755)
        # the agent may set user.overlay.opaque (the overlay stores it on the upper dir) ...
        r = a.exec(["/probe", "setxattr", "user.overlay.opaque", "/workspace/lib"])
        assert r.stdout.strip() == b"ok", (r.stdout, r.stderr)
        # ... but not the overlay's own trusted.overlay.* (no CAP_SYS_ADMIN in a sandbox)
        r = a.exec(["/probe", "setxattr", "trusted.overlay.opaque", "/workspace/bin"])
        assert r.stdout.strip() == b"EPERM", (r.stdout, r.stderr)
        a.exec("rm /probe")
        upper = a.handle.upper_dir()
        assert os.getxattr(upper / "workspace" / "lib", "user.overlay.opaque") == b"y"
        assert (upper / "etc" / ".wh.passwd").is_file()
        result = a.pack_diff(publish="snap/lookalikes")
    # restored in a new sandbox, nothing of the lower layers is deleted or hidden ...
    b = Sandbox.create("snap/lookalikes", store=store, node_dir=node)
    with b:
        assert _tree(b, "/etc/passwd", "/workspace/tests", "/workspace/bin",
                     "/workspace/README.md", "/workspace/lib") == lower
        r = b.exec("ls -a /etc /workspace /workspace/tests")
        assert b".wh." not in r.stdout, r.stdout
    # ... and the report names each thing left out
    decisions = {(d["path"], d["action"]) for d in result.report.decisions}
    assert {("etc/.wh.passwd", "dropped"), ("workspace/tests/.wh..wh..opq", "dropped"),
            ("workspace/.wh.bin", "dropped"), ("workspace/.wh.README.md", "dropped"),
            ("workspace/lib", "dropped-xattr")} <= decisions, result.report.decisions
    reasons = " ".join(d["reason"] for d in result.report.decisions)
    assert "reserved for OCI whiteouts" in reasons and "user.overlay.opaque" in reasons


# -- envbuild sandbox gc ------------------------------------------------------------------


def _orphans(busybox_store, node: Path, n: int, deep: int, probe: bytes,
             tmp_path: Path) -> list[str]:
    """``n`` sandboxes made by a process that is then killed (as a crash would), the one at
    index ``deep`` with a 4,096-deep tree made inside it."""
    store, _ = busybox_store
    (tmp_path / "probe.bin").write_bytes(probe)
    code = (
        "import sys, time\n"
        "from envbuild.store import LocalStore\n"
        "from runtime_shim.sdk import exitwatch\n"
        "from runtime_shim.sdk.sandbox import Sandbox\n"
        f"for i in range({n}):\n"
        f"    sb = Sandbox.create({ENV!r}, store=LocalStore({str(store.root)!r}),"
        f" node_dir={str(node)!r})\n"
        f"    if i == {deep}:\n"
        f"        sb.write_file('/probe', open({str(tmp_path / 'probe.bin')!r}, 'rb').read(),"
        " mode=0o755)\n"
        "        r = sb.exec('mkdir /workspace/deep && /probe mkdeep 4096 /workspace/deep')\n"
        "        assert r.exit_code == 0, r.stderr\n"
        "    exitwatch.stop()\n"  # a crash its watcher dies in too: gc removes what is left
        "    print(sb.id, flush=True)\n"
        "time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        ids = [proc.stdout.readline().strip() for _ in range(n)]
    finally:
        proc.kill()
        proc.wait()
    assert all(i.startswith("eb-") for i in ids), ids
    assert _depth(SandboxPaths(node / "sandboxes" / ids[deep]).upper / "workspace" / "deep") == 4096
    return ids


def _gc(node: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "envbuild.cli", "sandbox", "gc"],
                          env={**os.environ, "PYTHONPATH": str(REPO),
                               "ENVBUILD_NODE_CACHE": str(node)},
                          capture_output=True, text=True, timeout=300)


def _immutable(path: Path, on: bool) -> None:
    subprocess.run([require_tool("chattr"), "+i" if on else "-i", str(path)], check=True)


def test_sandbox_gc_removes_every_orphan_it_can_and_reports_the_rest(busybox_store, tmp_path,
                                                                     probe):
    require_root()
    node = tmp_path / "node"
    ids = _orphans(busybox_store, node, 3, deep=1, probe=probe, tmp_path=tmp_path)
    deep_id, stuck_id = ids[1], ids[2]
    infos = {i.id: i for i in list_sandboxes(node)}
    assert all(i in infos and not infos[i].alive for i in ids)
    # an immutable file (chattr +i, as a host tool may leave) in the sandbox dir on the host's
    # filesystem (inside the sandbox's own disk it would go with the disk): unlink gets EPERM
    stuck = infos[stuck_id].path / "etc" / "pinned"
    stuck.parent.mkdir(parents=True, exist_ok=True)
    stuck.write_text("x")
    _immutable(stuck, True)
    try:
        gc = _gc(node)
        assert gc.returncode == 1, (gc.stdout, gc.stderr)
        assert "Traceback" not in gc.stderr and "bug" not in gc.stderr, gc.stderr
        lines = gc.stdout.splitlines()
        assert sorted(lines) == sorted([f"removed {ids[0]}", f"removed {deep_id}",
                                        next(x for x in lines if x.startswith("failed"))])
        failed = next(x for x in lines if x.startswith("failed"))
        assert failed.startswith(f"failed  {stuck_id}: ") and "not permitted" in failed
        assert "pinned" in failed, failed
        assert "could not be removed" in gc.stderr
        left = {i.id for i in list_sandboxes(node)}
        assert left == {stuck_id}  # the deep one and the other are gone, the stuck one stays
    finally:
        _immutable(stuck, False)
    gc = _gc(node)  # the cause fixed, the next gc finishes the job
    assert gc.returncode == 0 and gc.stdout.splitlines()[0] == f"removed {stuck_id}", gc
    assert list_sandboxes(node) == []
    assert os.listdir(node / "sandboxes") == []


def test_sandbox_rm_removes_a_4096_deep_sandbox(busybox_store, tmp_path, envbuild_cli, probe):
    node = tmp_path / "node-rm"
    [sid] = _orphans(busybox_store, node, 1, deep=0, probe=probe, tmp_path=tmp_path)
    envbuild_cli.node = node
    res = envbuild_cli("sandbox", "rm", sid)
    assert res.code == 0 and res.out.strip() == f"removed {sid}", res
    assert not (node / "sandboxes" / sid).exists()


@pytest.fixture(autouse=True)
def _no_deep_leftovers(tmp_path):
    """A failing test must not leave a 4,096-deep tree behind: pytest's own tmp cleanup
    (``shutil.rmtree``) would hit the recursion limit on it."""
    yield
    for node in (tmp_path / "node", tmp_path / "node-rm"):
        for info in list_sandboxes(node):
            try:
                remove_sandbox(node, info.id)
            except Exception:  # noqa: BLE001 - best effort; the test already reported
                remove_tree(info.path, missing_ok=True)


WH_TOOLKIT = """\
apiVersion: envbuild/v1
kind: Toolkit
name: whtk
description: a build step that makes a file named like an OCI whiteout
build_on: busybox-tiny
requires: {abi: [busybox-amd64]}
prefix: /opt/toolkits/whtk
steps:
  - run: mkdir -p /opt/toolkits/whtk && echo x > /opt/toolkits/whtk/.wh.passwd
    network: none
"""


def test_a_build_step_file_named_like_a_whiteout_fails_the_build_in_one_line(envbuild_cli):
    (envbuild_cli.defs / "toolkits" / "whtk.yaml").write_text(WH_TOOLKIT)
    res = envbuild_cli("build", "whtk")
    assert res.code == 1, (res.out, res.err)
    assert "Traceback" not in res.err and "opt/toolkits/whtk/.wh.passwd" in res.err, res.err
    assert "reserved for OCI whiteouts" in res.err, res.err
