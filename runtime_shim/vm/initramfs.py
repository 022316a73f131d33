"""The guest's initramfs: busybox, the kernel modules, the exec agent and a small init.

Built by envbuild itself, reproducibly: the same inputs give the same bytes (entries sorted
by name, mtime 0, uid/gid 0, inode numbers in order, ``newc`` format, uncompressed because
the kernel would decompress it under emulation). It is cached by content hash in
``<cache>/vm/initramfs/<sha256>.cpio`` and shared by every VM on the host.

Layout (``initramfs_entries``, pure)::

    /init                  INIT_SCRIPT (busybox sh)
    /bin/busybox           the host's static busybox (busybox-static)
    /bin/envbuild-agent    the exec agent, when one is given
    /etc/modules           the module file names in load order, one a line
    /lib/modules/*.ko      uncompressed modules
    /dev/console           char 5:1, so init has a console before devtmpfs is mounted
    /disks /layers /newroot /proc /sys /stub /rw

The init (``INIT_SCRIPT``) is the guest side of the disk contract in ``runtime_shim.vm.backend``:
virtio-blk disks are found by serial (``eb-cfg``, ``eb-rw``, ``eb-l0`` … bottom layer first),
the config disk is a shell fragment (``EB_LAYERS``, ``EB_HOSTNAME``, ``EB_NET`` and
``set -- KEY=VALUE …`` for the env), each layer is mounted read-only as EROFS, the writable ext4
disk holds ``upper/`` and ``work/``, overlayfs composes them over a tmpfs ``stub`` of mount
points (with the same plain-upper options as containers: ``runtime_shim.mount``), the ext4
mount is moved to ``/.envbuild/rw`` (mode 0700, for ``fsfreeze`` at pack-diff), and
``switch_root`` starts the agent on the ``envbuild.agent`` virtio serial port. The
line ``envbuild-init: ready`` on the console marks the hand-over.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import stat
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from envbuild.errors import RuntimeShimError
from runtime_shim.mount import OVERLAY_PLAIN_OPTIONS
from runtime_shim.vm.kernel import GuestKernel, guest_modules

INITRAMFS_VERSION = 2
READY_MARKER = b"envbuild-init: ready"
FAILED_MARKER = b"envbuild-init: FAILED"
AGENT_PORT_NAME = "envbuild.agent"

INIT_SCRIPT = r"""#!/bin/busybox sh
# envbuild guest init (initramfs v2). See runtime_shim/vm/initramfs.py.
B=/bin/busybox
fail() { echo "envbuild-init: FAILED: $*" >/dev/console; $B poweroff -f; }
$B mount -t devtmpfs -o mode=0755 dev /dev || fail "mount /dev"
exec </dev/console >/dev/console 2>&1
$B mount -t proc proc /proc && $B mount -t sysfs sys /sys || fail "mount /proc /sys"
while read -r m; do $B insmod "/lib/modules/$m" || fail "insmod $m"; done </etc/modules
# (shell builtins where possible: every busybox fork+exec costs milliseconds under TCG)
for d in /sys/block/vd*; do
  s=
  read -r s <"$d/serial"  # sysfs has no trailing newline: read sets s and returns 1
  case "$s" in eb-*) $B ln -s "/dev/${d##*/}" "/disks/$s" ;; esac
done
[ -e /disks/eb-cfg ] || fail "no config disk"
$B tr -d '\000' </disks/eb-cfg >/cfg.sh && . /cfg.sh || fail "read config"
lower=/stub
i=0
while [ "$i" -lt "$EB_LAYERS" ]; do
  $B mkdir -p "/layers/$i"
  $B mount -t erofs -o ro "/disks/eb-l$i" "/layers/$i" || fail "mount layer $i"
  lower="/layers/$i:$lower"
  i=$((i + 1))
done
# Mount points every root needs, as the bottom layer (never copied into upper/).
$B mount -t tmpfs -o mode=0755 stub /stub && cd /stub &&
  $B mkdir -p proc sys dev tmp run .envbuild && $B chmod 1777 tmp && cd / || fail "stub"
$B mount -t ext4 -o noatime /disks/eb-rw /rw || fail "mount the writable disk"
$B mkdir -p /rw/upper /rw/work && $B chmod 0700 /rw || fail "make upper/ and work/"
# Plain upper dir (no redirects, metacopy, index): what pack-diff's layer writer accepts.
$B mount -t overlay overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work,@PLAIN@" \
  /newroot || fail "mount overlay"
R=/newroot
$B mount -t tmpfs -o mode=0755,size=32m eb $R/.envbuild && $B cp /bin/busybox $R/.envbuild/ ||
  fail "mount /.envbuild"
[ -x /bin/envbuild-agent ] && $B cp /bin/envbuild-agent $R/.envbuild/agent
# The writable disk stays reachable (root only) for fsfreeze when the host snapshots it.
$B mkdir $R/.envbuild/rw && $B mount --move /rw $R/.envbuild/rw || fail "move /rw"
$B mount -t tmpfs -o mode=1777,nosuid,nodev tmp $R/tmp
$B mount --move /dev $R/dev && $B mount --move /proc $R/proc && $B mount --move /sys $R/sys ||
  fail "move mounts"
$B mkdir -p $R/dev/pts $R/dev/shm
$B mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts $R/dev/pts
$B mount -t tmpfs -o mode=1777,nosuid,nodev shm $R/dev/shm
$B hostname "$EB_HOSTNAME"
$B ip link set lo up
if [ "$EB_NET" = 1 ]; then
  # QEMU user-mode network (slirp): fixed addresses.
  $B ip link set eth0 up && $B ip addr add 10.0.2.15/24 dev eth0 &&
    $B ip route add default via 10.0.2.2 || fail "network"
  echo "nameserver 10.0.2.3" >$R/.envbuild/resolv.conf
  [ -f $R/etc/resolv.conf ] && $B mount --bind $R/.envbuild/resolv.conf $R/etc/resolv.conf
fi
# The port appears once the device's control queue has announced it: wait up to 10 s.
port=
n=0
while [ -z "$port" ] && [ $n -lt 1000 ]; do
  for p in $R/sys/class/virtio-ports/*; do
    name=
    read -r name <"$p/name" 2>/dev/null
    [ "$name" = envbuild.agent ] && [ -e "$R/dev/${p##*/}" ] && port=/dev/${p##*/}
  done
  [ -n "$port" ] || $B usleep 10000
  n=$((n + 1))
done
[ -n "$port" ] || fail "no envbuild.agent virtio serial port"
[ -x $R/.envbuild/agent ] || fail "no agent in the initramfs"
read -r up _ <$R/proc/uptime
echo "envbuild-init: ready $up"
exec $B env -i "$@" $B switch_root $R /.envbuild/agent --serial "$port"
""".replace("@PLAIN@", ",".join(OVERLAY_PLAIN_OPTIONS))
#: Where the init leaves the writable disk's ext4 mount in the guest (``upper/``, ``work/``).
GUEST_RW_MOUNT = "/.envbuild/rw"


@dataclasses.dataclass(frozen=True)
class CpioEntry:
    name: str  # relative, no leading "/"
    mode: int  # full st_mode (type + permissions)
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def initramfs_entries(*, busybox: bytes, modules: Sequence[tuple[str, bytes]],
                      agent: bytes | None, init_script: str = INIT_SCRIPT) -> list[CpioEntry]:
    """Every entry of the initramfs, sorted by name (pure)."""
    d = stat.S_IFDIR | 0o755
    x = stat.S_IFREG | 0o755
    r = stat.S_IFREG | 0o644
    entries = [CpioEntry(p, d) for p in ("bin", "dev", "disks", "etc", "layers", "lib",
                                         "lib/modules", "newroot", "proc", "rw", "stub", "sys")]
    entries += [
        CpioEntry("init", x, init_script.encode()),
        CpioEntry("bin/busybox", x, busybox),
        CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        CpioEntry("etc/modules", r, "".join(f"{name}\n" for name, _ in modules).encode()),
    ]
    entries += [CpioEntry(f"lib/modules/{name}", r, data) for name, data in modules]
    if agent is not None:
        entries.append(CpioEntry("bin/envbuild-agent", x, agent))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise RuntimeShimError("initramfs: duplicate entry names (two modules of one name?)")
    return sorted(entries, key=lambda e: e.name)


def newc_archive(entries: Iterable[CpioEntry]) -> bytes:
    """A ``newc`` cpio archive of ``entries`` in the given order (pure, deterministic)."""
    out = bytearray()
    ino = 0
    for e in [*entries, CpioEntry("TRAILER!!!", 0)]:
        ino += 1
        name = e.name.encode() + b"\0"
        is_dir = stat.S_ISDIR(e.mode)
        fields = (ino if e.name != "TRAILER!!!" else 0, e.mode, 0, 0, 2 if is_dir else 1, 0,
                  len(e.data), 0, 0, e.rdev[0], e.rdev[1], len(name), 0)
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + name
        out += b"\0" * (-len(out) % 4)
        out += e.data
        out += b"\0" * (-len(out) % 4)
    out += b"\0" * (-len(out) % 512)
    return bytes(out)


def host_busybox() -> Path:
    for p in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.isfile(p):
            return Path(p)
    raise RuntimeShimError("the guest initramfs needs a static busybox on the host",
                           hint="apt-get install busybox-static (or run scripts/setup.sh)")


def ensure_initramfs(cache_dir: str | os.PathLike[str], kernel: GuestKernel,
                     agent_path: Path | None, *, network: bool = False) -> Path:
    """The initramfs for ``kernel`` (+ the agent), built once and cached by content hash."""
    busybox = host_busybox()
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                  for p in (busybox, kernel.modules_dir / "modules.dep",
                            *([agent_path] if agent_path else [])))
    return _ensure(str(cache_dir), kernel, str(agent_path) if agent_path else None, network,
                   stamp)


@functools.lru_cache(maxsize=16)
def _ensure(cache_dir: str, kernel: GuestKernel, agent_path: str | None, network: bool,
            _stamp: tuple) -> Path:
    # The stamp (paths, mtimes, sizes) only keys this in-process memo: reading and hashing
    # ~5 MB of inputs on every start would cost more than the rest of ``create``'s host work.
    entries = initramfs_entries(busybox=host_busybox().read_bytes(),
                                modules=guest_modules(kernel, network=network),
                                agent=Path(agent_path).read_bytes() if agent_path else None)
    data = newc_archive(entries)
    digest = hashlib.sha256(data).hexdigest()
    target = Path(cache_dir) / "vm" / "initramfs" / f"{digest}.cpio"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{digest[:12]}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
    return target
