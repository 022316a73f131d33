"""pack-diff on real overlayfs + runc: snapshots restore exactly, hostile uppers are tamed,
chains squash to the same tree."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from envbuild.layers import LayerReader
from runtime_shim.node.locks import resolve
from runtime_shim.node.packdiff import (
    SnapshotPolicy,
    SnapshotRefused,
    pack_upper,
    snapshot_chain,
    squash_snapshots,
)
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root
from tests.integration.conftest import build_busybox_env

ENV = "busybox-shell"

# Every file's type, mode, owner, size, link target and content hash: the whole visible tree.
LISTING = r"""
cd /
find . -xdev ! -path './proc*' ! -path './sys*' ! -path './dev*' ! -path './.envbuild*' \
  | sort | while read -r f; do
    if [ -f "$f" ] && [ ! -L "$f" ]; then sum=$(md5sum < "$f" | cut -c1-32); else sum=-; fi
    echo "$(stat -c '%n %F %a %u:%g %s %h' "$f") $(readlink "$f") $sum"
done
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("packdiff"))


def _sandbox(built, lock=ENV) -> Sandbox:
    store, node = built
    return Sandbox.create(lock, store=store, node_dir=node)


def _listing(sb: Sandbox) -> str:
    """The tree, each directory's size and link count blanked: what ``stat`` says of those is
    the filesystem's (ext4: its blocks, 2 + subdirs; btrfs, the node's disk pool: the bytes of
    its names, always 1 link), not content."""
    r = sb.exec(LISTING)
    assert r.exit_code == 0, r.stderr
    lines = []
    for line in r.stdout.decode().splitlines(keepends=True):
        fields = line.split(" ")
        if fields[1] == "directory":
            fields[4] = fields[5] = "-"
        lines.append(" ".join(fields))
    return "".join(lines)


def _xattr(sb: Sandbox, path: str) -> bytes | None:
    try:
        return os.getxattr(f"/proc/{sb.host_pid}/root{path}", "user.note")
    except OSError:
        return None


CHANGES = r"""
set -e
cd /workspace
echo added > added.txt                       # a new file
echo changed >> README.md                    # a modified file
rm tests/test_list.sh                        # a deleted file
rm -rf lib && echo now-a-file > lib          # a directory replaced by a file
rm bin/kv && mkdir -p bin/kv/inner && echo x > bin/kv/inner/f   # a file replaced by a dir
rm -rf tests && mkdir tests && echo fresh > tests/only.sh       # emptied, refilled: opaque
mkdir -p /opt/empty                          # an empty directory
chmod 0750 added.txt && chown 1000:1000 added.txt
ln -s ../workspace/added.txt /opt/link       # a symlink
ln added.txt hard.txt                        # a hardlink
chmod 4755 README.md                         # setuid: stripped by policy
"""


def test_snapshot_restores_every_kind_of_change(built):
    store, node = built
    with _sandbox(built) as a:
        assert a.exec(CHANGES).exit_code == 0
        os.setxattr(f"/proc/{a.host_pid}/root/workspace/added.txt", "user.note", b"hi")
        before = _listing(a)
        result = a.pack_diff("snap/every-change")
        assert result.ref == "snap/every-change"
        assert {(d["path"], d["action"]) for d in result.report.decisions} == {
            ("workspace/README.md", "stripped")}
        assert a.exec("echo still running").stdout == b"still running\n"  # resumed
    lock = resolve(store, "snap/every-change")
    assert lock.layers[-1].role == "snapshot"
    assert lock.manifest["annotations"]["org.envbuild.parent.lock"] == resolve(store, ENV).digest
    with _sandbox(built, "snap/every-change") as b:
        after = _listing(b)
        assert _xattr(b, "/workspace/added.txt") == b"hi"
    expected = before.replace("workspace/README.md regular file 4755", "workspace/README.md regular file 755")
    assert after == expected
    assert "./workspace/tests/test_basic.sh" not in after  # opaque dir: old entries gone
    assert "./workspace/lib regular file" in after and "./workspace/bin/kv directory" in after


def test_snapshot_of_a_snapshot_and_squash_give_the_same_tree(built):
    store, node = built
    with _sandbox(built) as s:
        s.exec("echo one > /workspace/one; rm /workspace/README.md; mkdir -p /d/e; echo 1 > /d/e/f")
        s.pack_diff("snap/chain-1")
    with _sandbox(built, "snap/chain-1") as s:
        s.exec("echo two > /workspace/two; rm -rf /d; mkdir /d; echo 2 > /d/g; "
               "echo back > /workspace/README.md")
        s.pack_diff("snap/chain-2")
    with _sandbox(built, "snap/chain-2") as s:
        s.exec("rm /workspace/one; echo three > /workspace/two")
        s.pack_diff("snap/chain-3")
        chained = _listing(s)
    lock = resolve(store, "snap/chain-3")
    assert snapshot_chain(lock) == 3
    with _sandbox(built, "snap/chain-3") as s:
        assert _listing(s) == chained
    squashed = squash_snapshots(store, lock, scratch=node, ref="snap/squashed")
    assert snapshot_chain(resolve(store, squashed)) == 1
    assert len(resolve(store, squashed).layers) == len(lock.layers) - 2
    with _sandbox(built, "snap/squashed") as s:
        listing = _listing(s)
    assert listing == chained
    assert "./d/e" not in listing and "./d/g" in listing


def test_max_chain_squashes_automatically(built):
    store, _ = built
    ref = ENV
    for i in range(3):
        with _sandbox(built, ref) as s:
            s.exec(f"echo {i} > /workspace/n{i}")
            result = s.pack_diff("snap/auto", max_chain=2)
        ref = "snap/auto"
        assert snapshot_chain(resolve(store, ref)) <= 2
        assert result.squashed == (i == 2)
    with _sandbox(built, "snap/auto") as s:
        assert s.exec("cat /workspace/n0 /workspace/n1 /workspace/n2").stdout == b"0\n1\n2\n"


def test_cli_keep_pack_diff_run(built, tmp_path):
    store, node = built
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node), "ENVBUILD_STORE": str(store.root)}
    cli = [sys.executable, "-m", "envbuild.cli"]
    kept = subprocess.run([*cli, "run", "--keep", ENV, "--", "sh", "-c",
                           "echo saved > /workspace/state"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert kept.returncode == 0, kept.stderr
    sandbox_id = kept.stderr.split("sandbox ")[1].split()[0]
    packed = subprocess.run([*cli, "pack-diff", sandbox_id, "--publish", "snap/cli", "--json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert packed.returncode == 0, packed.stderr
    assert json.loads(packed.stdout)["ref"] == "snap/cli"
    run = subprocess.run([*cli, "run", "snap/cli", "--", "cat", "/workspace/state"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.stdout == "saved\n"
    subprocess.run([*cli, "sandbox", "rm", sandbox_id], env=env, check=True, capture_output=True)


# ---------------------------------------------------------------- hostile upper dirs


def _pack(upper, policy=SnapshotPolicy()):  # noqa: B008 - a frozen dataclass, never mutated
    out = io.BytesIO()
    info, report = pack_upper(upper, out, policy, name="hostile")
    out.seek(0)
    data = out.getvalue()
    reader = LayerReader(lambda off, n: data[off:off + n], len(data), name="hostile")
    return {e.path: e for e in reader.entries()}, report


def test_hostile_upper_is_tamed_and_every_decision_reported(tmp_path):
    require_root()
    up = tmp_path / "upper"
    (up / "bin").mkdir(parents=True)
    os.mknod(up / "bin" / "disk", 0o600 | 0o060000, os.makedev(8, 0))  # block device
    os.mknod(up / "bin" / "tty", 0o600 | 0o020000, os.makedev(4, 1))   # char device
    os.mkfifo(up / "bin" / "pipe")
    os.mknod(up / "bin" / "gone", 0o600 | 0o020000, os.makedev(0, 0))  # overlay whiteout: kept
    (up / "bin" / "su").write_bytes(b"#!/bin/sh\n")
    os.chmod(up / "bin" / "su", 0o6755)
    (up / "bin" / "cap").write_bytes(b"x")
    os.setxattr(up / "bin" / "cap", "security.capability",
                bytes.fromhex("0100000200200000000000000000000000000000"))
    os.setxattr(up / "bin" / "cap", "trusted.evil", b"1")
    os.setxattr(up / "bin" / "cap", "user.fine", b"ok")
    os.symlink("/etc/shadow", up / "bin" / "shadow")
    entries, report = _pack(up)
    assert set(entries) == {"bin", "bin/.wh.gone", "bin/su", "bin/cap", "bin/shadow"}
    assert entries["bin/su"].mode & 0o7777 == 0o755
    assert entries["bin/cap"].xattrs == {"user.fine": b"ok"}
    assert entries["bin/shadow"].type == "symlink" and entries["bin/shadow"].linkname == "/etc/shadow"
    actions = {(d["path"], d["action"], d["reason"]) for d in report.decisions}
    assert actions == {
        ("bin/disk", "dropped", "block device"), ("bin/tty", "dropped", "char device"),
        ("bin/pipe", "dropped", "fifo"), ("bin/su", "stripped", "setuid and setgid"),
        ("bin/cap", "dropped-xattr", "security.capability"),
        ("bin/cap", "dropped-xattr", "trusted.evil")}


def test_size_caps_refuse_the_snapshot(tmp_path):
    up = tmp_path / "upper"
    up.mkdir()
    (up / "big").write_bytes(b"x" * 2000)
    with pytest.raises(SnapshotRefused, match="over the 1000-byte limit per file"):
        _pack(up, SnapshotPolicy(max_file_bytes=1000))
    (up / "big").write_bytes(b"x" * 600)
    (up / "big2").write_bytes(b"x" * 600)
    with pytest.raises(SnapshotRefused, match="more than 1000 bytes changed"):
        _pack(up, SnapshotPolicy(max_total_bytes=1000))
    with pytest.raises(SnapshotRefused, match="more than 1 entries"):
        _pack(up, SnapshotPolicy(max_entries=1))


def test_hardlink_leaving_the_upper_dir_is_refused(tmp_path):
    outside = tmp_path / "host-file"
    outside.write_text("host")
    up = tmp_path / "upper"
    up.mkdir()
    os.link(outside, up / "inside")
    with pytest.raises(SnapshotRefused, match="hardlinked outside"):
        _pack(up)
    os.unlink(outside)  # now both names of the inode are in the upper dir... just one left
    os.link(up / "inside", up / "second")
    entries, _ = _pack(up)
    assert entries["second"].type == "hardlink" or entries["inside"].type == "hardlink"


def test_a_snapshot_layer_gets_the_import_index_of_the_pycs_it_holds(built, tmp_path):
    """An agent's ``pip install`` lands pycs in the sandbox: the snapshot layer of them is
    indexed as it is stored (``runtime_shim.lazyfs.pyindex``), so lazy sandboxes started
    from the snapshot predict those modules' imports as they do a built layer's."""
    import py_compile
    import sys

    from envbuild.store import PYIMPORT_RECORDS

    store, _ = built
    src = tmp_path / "mod.py"
    src.write_text("import json\nfrom . import sibling\n")
    pyc = tmp_path / "mod.pyc"
    py_compile.compile(str(src), str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    path = f"workspace/site/pkg/__pycache__/mod.{sys.implementation.cache_tag}.pyc"
    with _sandbox(built) as sb:
        assert sb.exec("mkdir -p /workspace/site/pkg/__pycache__").exit_code == 0
        sb.write_file("/" + path, pyc.read_bytes())
        result = sb.pack_diff("snap/with-a-pyc")
    rec = store.get_record(PYIMPORT_RECORDS, result.layer[7:])
    assert rec is not None and rec["layer"] == result.layer and list(rec["pycs"]) == [path]
    names = rec["names"]
    flat = rec["pycs"][path]
    assert [names[flat[0]], flat[1]] == ["json", 0] and names[flat[3]] == ""   # from . import
