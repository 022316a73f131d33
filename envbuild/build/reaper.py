"""Reap the build scratch dirs of dead builders in one node cache's ``builds/`` (side effects).

A build holds its scratch dir ``builds/<id>`` through the owner file ``builds/<id>.owner``,
``flock``ed for its whole life (``scratch.claim_scratch``); the kernel drops the lock when the
process dies, however it dies (SIGKILL, OOM, a Ray worker that ``_exit``s when its raylet is
killed). A dir whose owner file this process can lock belongs to nobody, and what it may still
hold is undone here, in this order:

1. its step containers: the ids in the dir's own bundles (``bundle-*/config.json``, the
   container id is the last part of ``linux.cgroupsPath``) and every container of the node's
   runc state root whose bundle lies in the dir: ``runc delete --force`` (kills the
   container's processes, removes its state and cgroups);
2. those containers' cgroups (``/envbuild/<id>`` in every hierarchy) that runc no longer knew
   (a ``runc run`` killed between creating the cgroup and writing its state): every process in
   them SIGKILLed, the dirs removed;
3. a step's network (``net-*``: slirp4netns and the namespace file);
4. every mount at or below the dir, deepest first (the overlay ``merged``, then the ext4
   ``disk``), never following a symlink in the last component (``UMOUNT_NOFOLLOW``);
5. a loop device still backed by a file in the dir (``/sys/block/loop*/loop/backing_file``;
   the disks are autoclear, so this only finds a device a lazy unmount left): detached;
6. the tree (``safefs.remove_tree``: no symlink followed, no mount crossed), then the owner
   file.

Safety: only ``builds/`` of the node cache it is given (the path is the builder's own
configuration, the only one it trusts), only names that have an owner file it could lock (a
live build's lock is held, a dir being created has its owner file locked before either is
visible), and never through a symlink: an entry that is a symlink (or not a directory) has
only its own name removed, ``builds`` itself a symlink is refused. A dir that cannot be fully
reaped now (a mount busy past its lazy detach, a cgroup whose processes will not die) keeps its
owner file, so the next reap tries again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import signal
import stat
import time
from pathlib import Path

from envbuild.build.scratch import OWNER_SUFFIX
from envbuild.errors import EnvbuildError
from envbuild.safefs import remove_tree
from runtime_shim.isolation import OciRuntime, destroy, list_containers, mounted_targets_under, netns, unmount

#: Prefix of build step container ids (``executor._run_step``).
BUILD_CONTAINER_PREFIX = "eb-build-"
#: The parent cgroup of build steps (``cgroupsPath`` ``/envbuild/<id>``).
CGROUP_PARENT = "envbuild"
_LOOP_CLR_FD = 0x4C01
#: A bundle's config.json is ours, but read bounded all the same.
_CONFIG_CAP = 1 << 20
#: How long to wait for a killed cgroup to empty (seconds).
_CGROUP_WAIT = 5.0


@dataclasses.dataclass(frozen=True)
class Reaped:
    """One reaped build dir: its name, the container ids and loop devices found for it."""

    name: str
    containers: tuple[str, ...] = ()
    loop_devices: tuple[str, ...] = ()


def reap_stale_builds(root: str | os.PathLike[str], runtime: OciRuntime | None = None
                      ) -> list[Reaped]:
    """Reap every build dir under ``root`` (a node cache's ``builds/``) whose owner is gone;
    returns what was reaped. A dir that cannot be fully reaped now is left for the next call."""
    root = Path(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):  # a symlink (or a file) where builds/ should be: not ours
        return []
    try:
        entries = sorted(e.name for e in os.scandir(root) if e.name.endswith(OWNER_SUFFIX)
                         and not e.name.startswith(".") and e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return []
    reaped: list[Reaped] = []
    containers: list[dict] | None = None
    for entry in entries:
        try:
            fd = os.open(root / entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, OSError):
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its build is alive
            name = entry[:-len(OWNER_SUFFIX)]
            scratch = root / name
            try:
                kind = os.lstat(scratch).st_mode
            except FileNotFoundError:
                kind = None
            if kind is not None and not stat.S_ISDIR(kind):
                # never ours to follow: remove the name only
                with contextlib.suppress(OSError):
                    os.unlink(scratch)
                kind = None
            if kind is None:
                with contextlib.suppress(OSError):
                    os.unlink(root / entry)
                reaped.append(Reaped(name))
                continue
            if containers is None:
                containers = _runtime_containers(runtime)
            try:
                got = _reap_dir(scratch, runtime, containers)
                os.unlink(root / entry)
            except (OSError, EnvbuildError):
                continue
            reaped.append(got)
        finally:
            os.close(fd)
    return reaped


def _runtime_containers(runtime: OciRuntime | None) -> list[dict]:
    if runtime is None:
        return []
    try:
        return list_containers(runtime, BUILD_CONTAINER_PREFIX)
    except Exception:  # noqa: BLE001 - no runtime state: nothing to stop there
        return []


def _reap_dir(scratch: Path, runtime: OciRuntime | None, containers: list[dict]) -> Reaped:
    ids = set(bundle_container_ids(scratch))
    ids |= {c["id"] for c in containers if str(c.get("bundle", "")).startswith(f"{scratch}/")}
    for cid in sorted(ids):
        if runtime is not None:
            destroy(runtime, cid)
        kill_cgroups(cid)
    for net_dir in sorted(scratch.glob("net-*")):
        if net_dir.is_dir() and not net_dir.is_symlink():
            netns.teardown(net_dir)
    for target in mounted_targets_under(str(scratch)):  # deepest first: overlay, then the disk
        unmount(target, nofollow=True)
    loops = detach_loops_under(scratch)
    remove_tree(scratch)  # the disk image too, if its creator died before unlinking it
    return Reaped(scratch.name, tuple(sorted(ids)), tuple(loops))


def bundle_container_ids(scratch: Path) -> list[str]:
    """The container ids named by the bundles in a build dir (``linux.cgroupsPath``
    ``/envbuild/<id>``), read without following symlinks; malformed ones are skipped."""
    out: list[str] = []
    for bundle in sorted(scratch.glob("bundle-*")):
        try:
            fd = os.open(bundle / "config.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if bundle.is_symlink():
                continue
            raw = os.read(fd, _CONFIG_CAP)
        finally:
            os.close(fd)
        try:
            path = json.loads(raw)["linux"]["cgroupsPath"]
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(path, str):
            continue
        parent, _, cid = path.strip("/").partition("/")
        if parent == CGROUP_PARENT and _plain_id(cid):
            out.append(cid)
    return out


def _plain_id(cid: str) -> bool:
    return cid.startswith(BUILD_CONTAINER_PREFIX) and cid.replace("-", "").isalnum()


def cgroup_dirs(container_id: str) -> list[Path]:
    """The existing cgroup dirs of a build container, one per hierarchy that has one."""
    if not _plain_id(container_id):
        return []
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                d = Path(fields[4]) / CGROUP_PARENT / container_id
                if d.is_dir() and not d.is_symlink() and d not in found:
                    found.append(d)
    return found


def kill_cgroups(container_id: str) -> None:
    """SIGKILL every process in the container's cgroups, then remove the dirs (a build step's
    cgroup has no children: runc makes none)."""
    dirs = cgroup_dirs(container_id)
    deadline = time.monotonic() + _CGROUP_WAIT
    while dirs:
        for d in dirs:
            with contextlib.suppress(OSError, ValueError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.rmdir(d)
        dirs = [d for d in dirs if d.is_dir()]
        if not dirs:
            return
        if time.monotonic() > deadline:
            raise OSError(errno.EBUSY, "cgroup still has processes", str(dirs[0]))
        time.sleep(0.05)


def loops_backed_under(prefix: Path) -> list[str]:
    """Loop devices (``/dev/loopN``) whose backing file is at or below ``prefix`` (an unlinked
    image shows as ``<path> (deleted)``)."""
    want = str(prefix).rstrip("/") + "/"
    out: list[str] = []
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return out
    for name in sorted(names):
        if not name.startswith("loop"):
            continue
        try:
            with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8",
                      errors="surrogateescape") as f:
                backing = f.read().rstrip("\n")
        except OSError:
            continue  # not attached
        if backing.startswith(want):
            out.append(f"/dev/{name}")
    return out


def detach_loops_under(prefix: Path) -> list[str]:
    """Detach the loop devices backed by files under ``prefix`` (the mounts on them are gone:
    ``LOOP_CLR_FD``; autoclear ones detach at their last close anyway). Returns them."""
    found = loops_backed_under(prefix)
    for dev in found:
        try:
            fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, _LOOP_CLR_FD)
        finally:
            os.close(fd)
    return found


def sweep_stale_scratch(root: Path, runtime: OciRuntime | None = None) -> list[str]:
    """Remove the scratch dirs under ``root`` whose build is gone (its owner file can be
    locked): their containers, cgroups, networks, mounts and loop devices, then the tree
    (``envbuild.build.reaper``). Returns the names removed; a dir that cannot be removed now is
    left for the next sweep."""
    return [r.name for r in reap_stale_builds(root, runtime)]
