"""The guest's initramfs: busybox, the kernel modules, the exec agent and a small init.

Built by envbuild itself, reproducibly: the same inputs give the same bytes (entries sorted
by name, mtime 0, uid/gid 0, inode numbers in order, ``newc`` format, uncompressed because
the kernel would decompress it under emulation). It is cached by content hash in
``<cache>/vm/initramfs/<sha256>.cpio`` and shared by every VM on the host.

Layout (``initramfs_entries``, pure)::

    /init                       INIT_SCRIPT (busybox sh)
    /.envbuild/busybox          the host's static busybox (busybox-static); mode 0700 dir
    /.envbuild/agent            the exec agent, when one is given
    /.envbuild/rw/              mount point of the writable disk (GUEST_RW_MOUNT)
    /bin/busybox                symlink to /.envbuild/busybox
    /etc/fstab.boot             /dev, /proc, /sys (BOOT_FSTAB)
    /etc/modules                the module names in load order, on one line
    /lib/modules/<version>/     uncompressed modules and a modules.dep for busybox modprobe
    /dev/console                char 5:1, so init has a console before devtmpfs is mounted
    /layers/0 … /layers/20      mount points of the layers
    /newroot /proc /sys /rw

The init (``INIT_SCRIPT``) is the guest side of the disk contract in ``runtime_shim.backends.vm.backend``:
virtio-blk disks are found by serial (``eb-cfg``, ``eb-rw``, ``eb-l0`` … bottom layer first;
with ``EB_PMEM=1`` in the config the layers are instead the virtio-pmem devices in PCI slots
``qemu.PMEM_FIRST_SLOT + i``, mounted ``ro,dax=always``),
the config disk is a shell fragment (``EB_LAYERS``, ``EB_HOSTNAME``, ``EB_NET`` and
``set -- KEY=VALUE …`` for the env) sourced from the device, each layer is mounted read-only as
EROFS, the writable ext4 disk holds ``upper/``, ``work/`` and ``stub/`` (the mount points every
root needs, as the bottom layer: ``runtime_shim.backends.vm.erofs.make_writable_disk``), overlayfs
composes them (with the same plain-upper options as containers: ``runtime_shim.isolation.mount``), the
ext4 mount is moved to ``/.envbuild/rw`` (for ``fsfreeze`` at pack-diff), the initramfs's
``/.envbuild`` is bind-mounted at the new root's, and the init moves the new root onto ``/``
and chroots into it, starting the agent on the ``envbuild.agent`` virtio serial port (as
``switch_root`` would, but without deleting the initramfs, which ``/.envbuild`` lives on).
The line ``envbuild-init: ready`` on the console marks the hand-over.

Speed: under TCG every busybox process the init starts costs ~3 ms, so the init runs five
(two ``mount -a``, one ``modprobe -a``, a ``mkdir`` and the final ``mount --move``) and does
the rest with shell builtins, against ~45 for v2 (one per mount, ``insmod``, ``ln``, ``mkdir``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from runtime_shim.backends.vm.kernel import GuestKernel, guest_modules
from runtime_shim.backends.vm.qemu import PMEM_FIRST_SLOT
from runtime_shim.isolation.mount import OVERLAY_PLAIN_OPTIONS

INITRAMFS_VERSION = 2
READY_MARKER = b"envbuild-init: ready"
FAILED_MARKER = b"envbuild-init: FAILED"
AGENT_PORT_NAME = "envbuild.agent"
#: virtio-mmio transports on ``-M microvm`` (with its second IO-APIC): 24, minus the writable
#: disk, the config disk and the serial device; the initramfs has a mount point for each.
MAX_LAYERS = 21

INIT_SCRIPT = r"""#!/bin/busybox sh
# envbuild guest init (initramfs v3). See runtime_shim/backends/vm/initramfs.py.
# Every busybox process costs ~3 ms under TCG: shell builtins wherever they do (echo into
# /proc and /sys included), one modprobe for all the modules and one mount -a for all the
# mounts of the root.
B=/bin/busybox
R=/newroot
fail() { echo "envbuild-init: FAILED: $*" >/dev/console; $B poweroff -f; }
$B mount -a -T /etc/fstab.boot || fail "mount /dev /proc /sys"
exec </dev/console >/dev/console 2>&1
read -r mods </etc/modules
$B modprobe -a $mods || fail "load the modules: $mods"
for d in /sys/block/vd*; do
  s=
  read -r s <"$d/serial"  # sysfs has no trailing newline: read sets s and returns 1
  case "$s" in eb-cfg | eb-rw | eb-l[0-9] | eb-l[0-9][0-9]) eval "disk_${s#eb-}=/dev/${d##*/}" ;; esac
done
[ -n "$disk_cfg" ] && [ -n "$disk_rw" ] || fail "no config or writable disk"
. "$disk_cfg" || fail "read config"
lopt=ro
if [ "$EB_PMEM" = 1 ]; then
  # Layer i is the virtio-pmem device in PCI slot @PMEM_SLOT@ + i (runtime_shim.backends.vm.qemu), mounted
  # with DAX: its pages are the host's page cache of the image, shared by every VM.
  n=0
  while :; do
    found=0
    for p in /sys/devices/pci0000:00/0000:00:*/virtio*/ndbus*/region*/namespace*/block/pmem*; do
      [ -e "$p" ] || continue
      s=${p#/sys/devices/pci0000:00/0000:00:}
      s=${s%%.*}
      eval "disk_l$((0x$s - @PMEM_SLOT@))=/dev/${p##*/}"
      found=$((found + 1))
    done
    [ "$found" -ge "$EB_LAYERS" ] && break
    [ $n -lt 500 ] || fail "found $found of $EB_LAYERS layer pmem devices"
    $B usleep 10000
    n=$((n + 1))
  done
  lopt=ro,dax=always
fi
# The writable disk comes with upper/, work/ and stub/ (mount points every root needs, the
# bottom layer, never copied into upper/): runtime_shim.backends.vm.erofs.make_writable_disk.
lower=/rw/stub
i=0
{
  while [ "$i" -lt "$EB_LAYERS" ]; do
    eval "d=\$disk_l$i"
    [ -n "$d" ] || fail "no disk for layer $i"
    echo "$d /layers/$i erofs $lopt 0 0"
    lower="/layers/$i:$lower"
    i=$((i + 1))
  done
  echo "$disk_rw /rw ext4 noatime 0 0"
  # Plain upper dir (no redirects, metacopy, index): what pack-diff's layer writer accepts.
  echo "overlay $R overlay lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work,@PLAIN@ 0 0"
  # The agent and busybox stay in the initramfs (no switch_root deletes it); the writable
  # disk stays reachable (root only) for fsfreeze when the host snapshots it.
  echo "/.envbuild $R/.envbuild none bind 0 0"
  echo "/rw $R/.envbuild/rw none move 0 0"
  echo "tmp $R/tmp tmpfs mode=1777,nosuid,nodev 0 0"
  echo "/dev $R/dev none move 0 0"
  echo "/proc $R/proc none move 0 0"
  echo "/sys $R/sys none move 0 0"
  echo "devpts $R/dev/pts devpts newinstance,ptmxmode=0666,mode=0620 0 0"
  echo "shm $R/dev/shm tmpfs mode=1777,nosuid,nodev 0 0"
} >/etc/fstab.root
$B mkdir /dev/pts /dev/shm && $B mount -a -T /etc/fstab.root || fail "mount the root"
echo "$EB_HOSTNAME" >$R/proc/sys/kernel/hostname
echo 9 >$R/sys/class/net/lo/flags  # IFF_UP | IFF_LOOPBACK: ip link set lo up
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
# switch_root without its deletion of the initramfs, which holds /.envbuild.
cd $R && $B mount --move . / || fail "move the root"
exec $B env -i "$@" $B chroot . /.envbuild/agent --serial "$port"
""".replace("@PLAIN@", ",".join(OVERLAY_PLAIN_OPTIONS)).replace("@PMEM_SLOT@", str(PMEM_FIRST_SLOT))
#: Where the init leaves the writable disk's ext4 mount in the guest (``upper/``, ``work/``).
GUEST_RW_MOUNT = "/.envbuild/rw"
#: The first mounts, before the modules: ``mount -a -T /etc/fstab.boot``.
BOOT_FSTAB = """dev /dev devtmpfs mode=0755 0 0
proc /proc proc defaults 0 0
sys /sys sysfs defaults 0 0
"""


@dataclasses.dataclass(frozen=True)
class CpioEntry:
    name: str  # relative, no leading "/"
    mode: int  # full st_mode (type + permissions)
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def initramfs_entries(*, busybox: bytes, modules: Sequence[tuple[str, bytes]],
                      agent: bytes | None, init_script: str = INIT_SCRIPT,
                      kernel_version: str = "") -> list[CpioEntry]:
    """Every entry of the initramfs, sorted by name (pure). ``modules`` (in load order) go to
    ``lib/modules/<kernel_version>/`` with a ``modules.dep`` for busybox ``modprobe``."""
    if modules and not kernel_version:
        raise ValueError("initramfs: modules need the kernel version (their directory)")
    d = stat.S_IFDIR | 0o755
    x = stat.S_IFREG | 0o755
    r = stat.S_IFREG | 0o644
    mod_dir = f"lib/modules/{kernel_version}"
    entries = [CpioEntry(p, d) for p in (
        "bin", "dev", "etc", "lib", "lib/modules", "newroot", "proc", "rw", "sys", "layers",
        *(f"layers/{i}" for i in range(MAX_LAYERS)), *([mod_dir] if modules else ()))]
    entries += [
        CpioEntry("init", x, init_script.encode()),
        # root only: the writable disk's mount point is inside (GUEST_RW_MOUNT)
        CpioEntry(".envbuild", stat.S_IFDIR | 0o700),
        CpioEntry(".envbuild/busybox", x, busybox),
        CpioEntry(".envbuild/rw", d),
        CpioEntry("bin/busybox", stat.S_IFLNK | 0o777, b"/.envbuild/busybox"),
        CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        CpioEntry("etc/fstab.boot", r, BOOT_FSTAB.encode()),
        # one line: the init runs `modprobe -a $(cat)` without the cat
        CpioEntry("etc/modules", r, (" ".join(name.removesuffix(".ko")
                                              for name, _ in modules) + "\n").encode()),
    ]
    if modules:
        # No dependencies listed: modprobe -a loads them in the given (dependency) order.
        dep = "".join(f"{name}:\n" for name, _ in modules)
        entries.append(CpioEntry(f"{mod_dir}/modules.dep", r, dep.encode()))
    entries += [CpioEntry(f"{mod_dir}/{name}", r, data) for name, data in modules]
    if agent is not None:
        entries.append(CpioEntry(".envbuild/agent", x, agent))
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
                     agent_path: Path | None, *, network: bool = False, pmem: bool = False,
                     balloon: bool = False) -> Path:
    """The initramfs for ``kernel`` (+ the agent), built once and cached by content hash."""
    busybox = host_busybox()
    stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                  for p in (busybox, kernel.modules_dir / "modules.dep",
                            *([agent_path] if agent_path else [])))
    return _ensure(str(cache_dir), kernel, str(agent_path) if agent_path else None, network,
                   pmem, balloon, stamp)


@functools.lru_cache(maxsize=16)
def _ensure(cache_dir: str, kernel: GuestKernel, agent_path: str | None, network: bool,
            pmem: bool, balloon: bool, _stamp: tuple) -> Path:
    # The stamp (paths, mtimes, sizes) only keys this in-process memo: reading and hashing
    # ~5 MB of inputs on every start would cost more than the rest of ``create``'s host work.
    entries = initramfs_entries(busybox=host_busybox().read_bytes(),
                                modules=guest_modules(kernel, network=network, pmem=pmem,
                                                      balloon=balloon),
                                agent=Path(agent_path).read_bytes() if agent_path else None,
                                kernel_version=kernel.version)
    data = newc_archive(entries)
    digest = hashlib.sha256(data).hexdigest()
    target = Path(cache_dir) / "vm" / "initramfs" / f"{digest}.cpio"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, data, fsync=True)
    return target
