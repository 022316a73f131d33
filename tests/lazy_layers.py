"""Two-layer stores for the lazy-layer tests (``tests/integration/test_lazy_native*.py``):
every kind of member — whiteouts, an opaque dir, a replaced dir, hardlinks, a fifo, symlinks,
modes, owners, a setuid file, xattrs — packed as envbuild layers into a real store, and the
listing that compares a lazy sandbox's tree with a full pull's."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from envbuild.layers import pack_tree
from envbuild.oci import MEDIA_TYPE_CONFIG
from envbuild.plan.lockspec import LockLayer, RuntimeConfig, make_lock, merge_config
from envbuild.store import LocalStore, put_file, put_json
from tests.conftest import require_root, require_tool
from tests.integration.test_container_runtime import make_busybox_root

BIG = 3 << 20  # a file with frames of its own (lazy framing: >= 16 KiB, cut every 4 MiB)


def pack_layer(store, tree: Path, tmp_path: Path, name: str, **kw) -> LockLayer:
    blob = tmp_path / f"{name}.blob"
    with open(blob, "wb") as out:
        info = pack_tree(tree, out, **kw)
    put_file(store, blob)
    return LockLayer(name=name, role="toolkit", key="sha256:" + "0" * 64, digest=info.digest,
                     diff_id=info.diff_id, size=info.size, toc_digest=info.toc_digest)


def make_env(store, name: str, layers: list[LockLayer]) -> str:
    lock = make_lock(name, layers, merge_config([RuntimeConfig()]))
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref(f"env/{name}", digest)
    return digest


def member_trees(tmp_path: Path) -> tuple[Path, Path]:
    """A busybox base with every kind of member, and an upper layer (packed from an overlayfs
    upper dir) that deletes a file, replaces a directory and makes another one opaque."""
    base = make_busybox_root(tmp_path / "base")
    for applet in ("find", "stat", "sha256sum", "sort", "xargs", "ls", "wc", "head", "readlink"):
        if not (base / "bin" / applet).exists():
            os.symlink("busybox", base / "bin" / applet)
    etc = base / "etc"
    (etc / "os-release").write_text("NAME=lazy\n")
    (etc / "gone").write_text("deleted by the upper layer\n")
    (base / "data").mkdir()
    (base / "data" / "big.bin").write_bytes(os.urandom(BIG))
    (base / "data" / "small.txt").write_text("small\n" * 100)
    (base / "data" / "empty").write_bytes(b"")
    os.link(base / "data" / "small.txt", base / "data" / "hard.txt")
    os.symlink("../data/small.txt", base / "data" / "link")
    os.chmod(base / "data" / "small.txt", 0o640)
    os.chown(base / "data" / "small.txt", 1000, 1000)
    (base / "data" / "suid").write_text("#!/bin/sh\n")
    os.chmod(base / "data" / "suid", 0o4755)
    os.setxattr(base / "data" / "big.bin", "user.origin", b"test")
    os.mkfifo(base / "data" / "fifo")
    (base / "data" / "deep" / "er").mkdir(parents=True)
    (base / "data" / "deep" / "er" / "f").write_text("deep\n")
    (base / "opq").mkdir()
    for i in range(3):
        (base / "opq" / f"old{i}").write_text(f"old {i}\n")
    (base / "replaced").mkdir()
    (base / "replaced" / "inside").write_text("x\n")
    for p in (base / "data" / "small.txt", base / "etc" / "os-release"):
        os.utime(p, (1_600_000_000, 1_600_000_000))
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    os.mknod(upper / "etc" / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    (upper / "opq").mkdir()
    os.setxattr(upper / "opq", "trusted.overlay.opaque", b"y")
    (upper / "opq" / "new").write_text("new\n")
    (upper / "replaced").write_text("now a file\n")
    (upper / "etc" / "added").write_text("from the upper layer\n")
    return base, upper


def two_layer_store(tmp_path: Path) -> tuple[LocalStore, list[LockLayer]]:
    """A local store with the two-layer lock ``two`` of ``member_trees`` (every kind of member,
    whiteouts, an opaque dir, hardlinks, xattrs), and its layers: what the ``lock2`` fixtures
    (test_lazy_native.py) stand on."""
    require_root()
    require_tool("runc")
    store = LocalStore(tmp_path / "store")
    base_tree, upper_tree = member_trees(tmp_path)
    base = pack_layer(store, base_tree, tmp_path, "base", source_date_epoch=1_700_000_000)
    upper = pack_layer(store, upper_tree, tmp_path, "upper", overlay_upper=True,
                  source_date_epoch=1_700_000_000)
    make_env(store, "two", [base, upper])
    return store, [base, upper]


LISTING = ("find / -xdev ! -path '/.envbuild*' ! -path '/proc*' ! -path '/sys*' "
           "! -path '/dev*' ! -path '/run*' ! -path '/tmp*' | sort | while read -r f; do "
           "if [ -d \"$f\" ] && [ ! -L \"$f\" ]; then stat -c '%n|%F|%a|%u|%g' \"$f\"; "
           "else stat -c '%n|%F|%a|%u|%g|%s|%Y|%h|%t,%T' \"$f\"; fi; done; "
           "find / -xdev -type f ! -path '/.envbuild*' ! -path '/proc*' ! -path '/sys*' "
           "| sort | xargs sha256sum; readlink /data/link; ls /opq")
