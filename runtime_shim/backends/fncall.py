"""The ``fncall`` backend: stateless function calls served by warm container sandboxes.

``fn = Sandbox.create(lock, backend="fncall")`` then ``fn.call(argv, stdin=…, files={…},
timeout=…) -> ExecResult``, or ``FnPool(lock, size=k).call(…)`` (``runtime_shim.sdk.fnpool``)
for ``k`` such sandboxes serving calls from many threads. Every call runs in a fresh writable
layer: nothing one call wrote, started or changed is seen by the next
(``tests/security/test_fncall.py``).

How (measured to be the fast way that keeps a container sandbox's isolation): a sandbox is one
warm runc container, with the container backend's seccomp filter (narrowed further: SysV IPC
and POSIX message queues are refused), dropped capabilities, no network, ``noNewPrivileges``,
its pids / memory / CPU cgroup and its capped disk (``runtime_shim.node.diskpool``). Its root is
the lock's layers as a **read-only** overlay (``<sandbox>/base``); every top-level directory of
the image (``/tmp``, ``/root``, ``/etc``, ``/usr``, … but not ``/proc``, ``/sys``, ``/dev``) and
``/dev/shm`` is a *slot*, covered by an overlay whose lower dir is that directory of the base
and whose upper dir is fresh and empty (on the sandbox's disk). The host makes each such
overlay as a detached mount (``fsopen``/``fsmount``) and a short-lived child that joined the
sandbox's mount namespace detaches the slot's old layer and attaches the new one
(``move_mount``): no process of the sandbox is involved, no capability is granted to it, and
nothing of the slots is mounted in the host's namespace (so no mount namespace cloned elsewhere
on the host holds a copy or a peer of one; an earlier design with shared mounts and ``rslave``
propagation lost slots that way to other users' ``runc init`` and CRIU on this machine).

**Every call in namespaces of its own** (issue 34: a queue made through ``/dev/mqueue``,
``/dev/pts`` modes, the pid counter, the network namespace's counters and the agent's rlimits,
nice value, affinity … that a root call could change with ``prlimit``/``renice``/``taskset``
all reached the next tenant). The container's PID 1 (the *anchor*) runs no call: each call
gets an agent of its own, PID 1 of new PID, IPC, UTS, network and mount namespaces, in the
container's cgroup and with exactly the anchor's confinement, with its own ``/proc``, ``/sys``,
``/dev/pts`` and ``/dev/mqueue`` (``runtime_shim.isolation.fncall_ns``). A call cannot see the anchor or
any earlier call's processes or kernel objects; when it returns its PID 1 is killed, which ends
every process it started. What calls still share is the container's file systems, which the
reset below puts back.

Between two calls (``reset``): every process but the anchor is killed — the cgroup is frozen
first, so nothing forks past the kill — and the sandbox waits until its cgroup holds the
anchor alone; then each slot whose upper dir is not exactly as mounted (an entry in it, or its
own mode/owner/times/xattrs changed) gets a fresh overlay and the old upper dir is deleted. A
slot no call wrote to is, by construction of overlayfs, the base unchanged, and is kept. What
cannot be reset in place — a change to ``/dev`` (a tmpfs runc makes, root-writable), processes
that will not die — retires the container: it is deleted and started again on fresh slots. A
call past its ``timeout`` is killed by the agent and its leftovers by the reset, like any call.

Before every call the host checks that the sandbox sees each slot's current layer (one
``stat`` per slot) and restarts the container if not. Slots stack a second overlay on the base
overlay: the node's layer dirs must not themselves be on overlayfs (the kernel's stacking limit
is 2).

Writes outside the slots (a new top-level entry in ``/``) fail with ``EROFS``. ``files`` are
written through the sandbox's root (``runtime_shim.isolation.fsaccess``: never following a symlink) into
the fresh layer just before the call; ``read_file`` after a call reads what it left (the layer
is reset when the next call starts; the call's processes are killed as soon as it returns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envbuild.errors import BackendUnavailable, RuntimeShimError
from envbuild.libc import LIBC
from envbuild.safefs import remove_tree
from runtime_shim.backends.base import CreateRequest
from runtime_shim.backends.container import ContainerSandbox
from runtime_shim.isolation import agent, cgroupfs, fncall_ns, fsaccess
from runtime_shim.isolation import seccomp as seccomp_profiles
from runtime_shim.isolation.mount import (
    _AT_FDCWD,
    _FSCONFIG_CMD_CREATE,
    _FSCONFIG_SET_STRING,
    _MOVE_MOUNT_F_EMPTY_PATH,
    _SYS_FSCONFIG,
    _SYS_FSMOUNT,
    _SYS_FSOPEN,
    _SYS_MOVE_MOUNT,
    MNT_DETACH,
    OVERLAY_PLAIN_OPTIONS,
    OverlaySpec,
    _os_error,
    mount_overlay,
    raw_syscall,
    raw_umount2,
)
from runtime_shim.isolation.runc import OciRuntime, destroy
from runtime_shim.isolation.spec import BindMount, RuntimeSpecRequest
from runtime_shim.isolation.stub import AGENT_PATH, ensure_stub
from runtime_shim.node import diskpool
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.locks import ResolvedLock

__all__ = ["FNCALL_DENIED_SYSCALLS", "FnCallBackend", "FnSandbox", "fncall_profile"]

#: Syscalls whose objects live in the IPC namespace: refused in FnCall sandboxes (EPERM, like
#: every syscall the profile does not allow). Each call has a new IPC namespace now
#: (``runtime_shim.isolation.fncall_ns``); the refusal stays as a second wall.
FNCALL_DENIED_SYSCALLS = frozenset({
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr"})
#: Top-level names never made slots: runc's own mounts and the agent's bind.
_NOT_SLOTS = frozenset({"proc", "sys", "dev", ".envbuild"})
#: How long a reset waits for the killed processes of a call to be gone.
KILL_WAIT = 5.0
#: More entries than this in ``/dev`` (runc makes ~15) retire the container unread.
DEV_ENTRIES_MAX = 256
#: The listening socket of the current call's agent, in the sandbox dir (beside the anchor's).
CALL_SOCKET = "call.sock"
_CLONE_NEWNS = 0x00020000
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x2, 0x4


def fncall_profile(capabilities: Sequence[str]) -> dict[str, Any]:
    """The default seccomp profile (``runtime_shim.isolation.seccomp``) without ``FNCALL_DENIED_SYSCALLS``."""
    profile = seccomp_profiles.default_profile(capabilities)
    rules = []
    for rule in profile["syscalls"]:
        names = [n for n in rule["names"] if n not in FNCALL_DENIED_SYSCALLS]
        if names:
            rules.append({**rule, "names": names})
    return {**profile, "syscalls": rules}


@dataclasses.dataclass
class _Slot:
    """One directory of the sandbox whose writable layer is swapped per call."""

    dest: str  # in the sandbox: "/tmp", "/dev/shm"
    lower: Path
    layer: Path | None = None  # the current layer's dir on the disk (u/ and w/ in it)
    stamp: tuple = ()
    device: int = -1

    @property
    def upper(self) -> Path:
        assert self.layer is not None
        return self.layer / "u"


def plan_slots(base: Path, empty: Path) -> list[_Slot]:
    """The slots of a sandbox whose read-only root is ``base``: each top-level directory (not
    a symlink, not runc's), then ``/dev/shm`` over the empty dir ``empty``."""
    slots = []
    with os.scandir(base) as it:
        names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False)
                       and e.name not in _NOT_SLOTS)
    for name in names:
        slots.append(_Slot(f"/{name}", base / name))
    slots.append(_Slot("/dev/shm", empty))
    return slots


def _stamp(path: Path) -> tuple:
    st = os.lstat(path)
    return (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns,
            st.st_nlink, tuple(sorted(os.listxattr(path, follow_symlinks=False))))


def _clean(slot: _Slot) -> bool:
    """Whether the slot's layer is still exactly as mounted (no process may run)."""
    try:
        if _stamp(slot.upper) != slot.stamp:
            return False
        with os.scandir(slot.upper) as it:
            return next(it, None) is None
    except OSError:
        return False


class FnSandbox(ContainerSandbox):
    """One warm FnCall sandbox (a ``SandboxHandle``): a container sandbox whose writable
    layer is reset between calls (see the module docstring)."""

    def __init__(self, req: CreateRequest) -> None:
        if req.network is not None:
            raise BackendUnavailable("fncall sandboxes have no network",
                                     hint="use the container backend for network=")
        if req.limits.inotify:  # its profile is fncall_profile's, which never allows it
            raise BackendUnavailable("fncall sandboxes have no inotify",
                                     hint="use the container backend for Limits(inotify=True)")
        paths, limits = req.paths, req.limits
        if limits.disk_bytes is not None:
            diskpool.create_disk(req.layout, paths, limits, backend="fncall",
                                 template_root=req.node.root / "scratchfs")
        else:
            paths.disk.mkdir()
        self._layers_dir = paths.disk / "fncall"
        self._layers_dir.mkdir()
        self._generation = 0
        self._used = False
        self.restarts = 0  # containers retired (a change to /dev, processes that would not die)
        self._base = paths.root / "base"
        self._base.mkdir()
        empty = paths.root / "empty"
        empty.mkdir()
        os.chmod(empty, 0o1777)
        stub = str(ensure_stub(req.node.root))
        mount_overlay(OverlaySpec(str(self._base), (*reversed(req.layer_dirs), stub)))
        self._slots = plan_slots(self._base, empty)
        self._req = req
        self._serial = threading.RLock()  # one call at a time; a reset never runs beside one
        self._broken: str | None = None
        self._start()

    # ---- lifecycle -----------------------------------------------------------------------

    def _start(self) -> None:
        req = self._req
        agent_path = agent.agent_binary(req.node.root)
        profile = fncall_profile  # the default unless the caller brought a setting
        binds = (BindMount(str(agent_path), AGENT_PATH),)

        def hook(r: RuntimeSpecRequest) -> RuntimeSpecRequest:
            return dataclasses.replace(
                r, rootfs=str(self._base), readonly_rootfs=True, cwd="/", binds=binds,
                tmpfs=(), seccomp=profile(r.capabilities) if req.seccomp is None
                else req.seccomp)

        super().__init__(req.id, req.paths, req.lock,
                         OciRuntime(req.runtime, state_root=str(req.layout.runc)),
                         network=None, limits=req.limits, agent_path=agent_path,
                         seccomp=req.seccomp, spec_hook=hook)
        try:
            self._swap(self._slots)  # the first layers, put into the running container
            self._dev = self._dev_state()
            self._anchor_fd = os.pidfd_open(self.init_pid)
            self._confinement = fncall_ns.read_confinement(
                self.init_pid, seccomp=req.seccomp != "unconfined")
            self._spawn_argv = fncall_ns.spawn_argv(
                fncall_ns.spawner_binary(req.node.root), self._confinement)
        except BaseException:
            self._close_container()
            raise
        self._used = False

    def _close_container(self) -> None:
        anchor_fd, self._anchor_fd = getattr(self, "_anchor_fd", -1), -1
        if anchor_fd >= 0:
            os.close(anchor_fd)
        ContainerSandbox.close(self)

    def close(self) -> None:
        self._close_container()

    def _restart(self) -> None:
        """Retire the container and start a new one on fresh slots (what cannot be reset in
        place)."""
        self.restarts += 1
        self._close_container()  # its mount namespace, and every layer in it, goes too
        for slot in self._slots:
            if slot.layer is not None:
                remove_tree(slot.layer)
            slot.layer, slot.device = None, -1
        self._start()

    # ---- layers --------------------------------------------------------------------------

    def _swap(self, slots: list[_Slot]) -> None:
        """Give each of ``slots`` a new empty layer: the host makes each overlay as a
        detached mount (``fsmount``), and a child process that joined the sandbox's mount
        namespace detaches the slot's current layer and attaches the new one there
        (``move_mount``). Nothing is mounted in the host's namespace, so no other mount
        namespace of the host ever holds a copy or a peer of a slot. The old layers' files
        are deleted afterwards."""
        ops, fresh = [], []
        try:
            for slot in slots:
                self._generation += 1
                layer = self._layers_dir / f"{self._generation}"
                upper, work = layer / "u", layer / "w"
                upper.mkdir(parents=True)
                work.mkdir()
                st = os.stat(slot.lower)  # the merged root's mode and owner are the upper's
                os.chmod(upper, stat.S_IMODE(st.st_mode))
                os.chown(upper, st.st_uid, st.st_gid)
                mfd = _detached_overlay(str(slot.lower), str(upper), str(work))
                fresh.append((slot, layer, mfd, os.fstat(mfd).st_dev, _stamp(upper)))
                ops.append((slot.dest, mfd, slot.device if slot.layer is not None else None))
            _inject(self.init_pid, ops)
        finally:
            for _, _, mfd, _, _ in fresh:
                os.close(mfd)
        for slot, layer, _, device, stamp in fresh:
            old, slot.layer, slot.device, slot.stamp = slot.layer, layer, device, stamp
            if old is not None:
                remove_tree(old)

    def _dev_state(self) -> tuple | None:
        """``/dev`` as the sandbox sees it (a root-writable tmpfs runc makes; not a slot): its
        own mode/owner/xattrs and every entry's identity and times. None (never equal to a
        recorded state) past ``DEV_ENTRIES_MAX`` entries: a call that made that many is
        retired without reading them all."""
        root = f"/proc/{self.init_pid}/root/dev"
        st = os.lstat(root)
        entries: list[tuple] = [("", st.st_mode, st.st_uid, st.st_gid,
                                 tuple(sorted(os.listxattr(root, follow_symlinks=False))))]
        with os.scandir(root) as it:
            for e in it:
                if e.name == "shm":  # a slot (calls have /dev/pts and /dev/mqueue of their
                    continue         # own: these are the container's, checked as a wall)
                if len(entries) > DEV_ENTRIES_MAX:
                    return None
                st = e.stat(follow_symlinks=False)
                entries.append((e.name, st.st_ino, st.st_mode, st.st_uid, st.st_gid,
                                st.st_rdev, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(sorted(entries))

    def _slots_in_place(self) -> bool:
        """Whether the sandbox sees each slot's current layer (a check, one ``stat`` per
        slot: nothing but this module mounts in the sandbox's namespace)."""
        root = f"/proc/{self.init_pid}/root"
        try:
            return all(os.stat(root + s.dest).st_dev == s.device for s in self._slots)
        except OSError:
            return False

    def kill_strays(self) -> bool:
        """Kill every process but the anchor; True once the cgroup holds the anchor alone."""
        others = [p for p in cgroupfs.procs(self.id) if p != self.init_pid]
        if not others:
            return True
        freezer = cgroupfs.controller_dir("freezer", self.id)
        state = freezer[0] / "freezer.state" if freezer and freezer[1] == 1 else None
        if state is not None:  # nothing forks past the kill
            state.write_text("FROZEN")
            deadline = time.monotonic() + KILL_WAIT
            while state.read_text().strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.0005)
        try:
            for pid in cgroupfs.procs(self.id):
                if pid != self.init_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        finally:
            if state is not None:
                state.write_text("THAWED")
        deadline = time.monotonic() + KILL_WAIT
        while time.monotonic() < deadline:
            if [p for p in cgroupfs.procs(self.id) if p != self.init_pid] == []:
                return True
            for pid in cgroupfs.procs(self.id):  # a fork that raced the first round
                if pid != self.init_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)
        return False

    def reset(self) -> None:
        """Make the sandbox as it was before any call (a no-op when it is): see the module
        docstring. What fails in place retires the container; if even that fails the
        sandbox is broken for good and every later call raises ``RuntimeShimError``."""
        with self._serial:
            if self._broken:
                raise RuntimeShimError(f"fncall sandbox {self.id} is broken: {self._broken}",
                                       hint="close it and create another (FnPool does)")
            if not self._used and self._slots_in_place():
                return
            try:
                if self.kill_strays() and self._dev_state() == self._dev and \
                        self._slots_in_place():
                    dirty = [slot for slot in self._slots if not _clean(slot)]
                    if dirty:
                        self._swap(dirty)
                    self._used = False
                    return
            except (OSError, RuntimeShimError):
                pass  # retire it below
            try:
                self._restart()
            except BaseException as e:
                self._broken = f"restart failed: {e}"
                raise RuntimeShimError(f"reset fncall sandbox {self.id}: {e}") from e

    # ---- calls ---------------------------------------------------------------------------

    def exec(self, req: agent.ExecRequest, *, on_stdout: agent.OutputCallback | None = None,
             on_stderr: agent.OutputCallback | None = None) -> agent.ExecOutcome:
        """One stateless call: reset if an earlier call used the sandbox, then run ``req``;
        its leftover processes are killed as soon as it returns."""
        with self._serial:
            self.reset()
            self._used = True  # from here on, whatever happens, the next call gets a reset
            try:
                call_agent = self._spawn_call_agent()
                try:
                    return agent.run(self._connect_call, req, self.limits.output_bytes,
                                     deadline=self.limits.exec_timeout, on_stdout=on_stdout,
                                     on_stderr=on_stderr)
                finally:
                    call_agent.stop()  # ends its PID namespace
            finally:
                with contextlib.suppress(OSError):  # else the reset's own kill retries
                    self.kill_strays()

    def _spawn_call_agent(self) -> fncall_ns.CallAgent:
        """The agent of one call, in namespaces of its own (``runtime_shim.isolation.fncall_ns``), on
        a listening socket in the sandbox dir that only this call's agent holds."""
        listener = agent.listen_socket(self._dir_fd, CALL_SOCKET)
        log = os.open(self.paths.start_log, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            return fncall_ns.spawn(self.init_pid, self._anchor_fd, self._spawn_argv,
                                   self._confinement, listener.fileno(), log)
        finally:
            os.close(log)
            listener.close()

    def _connect_call(self) -> socket.socket:
        return agent.connect_agent(f"/proc/self/fd/{self._dir_fd}/{CALL_SOCKET}")

    def call(self, req: agent.ExecRequest, files: Mapping[str, bytes | str] | None = None
             ) -> agent.ExecOutcome:
        """``files`` (sandbox path → content, mode 0644, the lock's user) written into a
        fresh layer, then ``req`` run there."""
        with self._serial:
            self.reset()
            for path, data in (files or {}).items():
                self.write_file(path, data.encode() if isinstance(data, str) else data, 0o644)
            return self.exec(req)

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        """Write into the layer the next call sees (resetting first if a call used it)."""
        with self._serial:
            self.reset()
            super().write_file(path, data, mode)

    def open_write(self, path: str, mode: int, uid: int, gid: int, hold: int = 0
                   ) -> fsaccess.FileWriter:
        """As ``write_file``: into the layer the next call sees (reset first if used)."""
        with self._serial:
            self.reset()
            return super().open_write(path, mode, uid, gid, hold)

    def upper_dir(self) -> Path:  # pragma: no cover - not Snapshottable: no stable upper dir
        raise BackendUnavailable("pack-diff is not supported by the fncall backend")


def _detached_overlay(lower: str, upper: str, work: str) -> int:
    """An overlay (nosuid, nodev) as a detached mount: its fd (``fsopen``/``fsmount``)."""
    sc = raw_syscall
    fsfd = sc(_SYS_FSOPEN, b"overlay", 0)
    if fsfd < 0:
        raise RuntimeShimError(f"fsopen overlay: {_os_error('fsopen').strerror}",
                               hint="FnCall needs the new mount API (Linux >= 5.2)")
    try:
        for key, value in (("lowerdir", lower), ("upperdir", upper), ("workdir", work),
                           *(o.split("=", 1) for o in OVERLAY_PLAIN_OPTIONS)):
            if sc(_SYS_FSCONFIG, fsfd, _FSCONFIG_SET_STRING, key.encode(), value.encode(),
                  0) < 0:
                raise RuntimeShimError(f"overlay {key}={value}: "
                                       f"{_os_error('fsconfig').strerror}")
        if sc(_SYS_FSCONFIG, fsfd, _FSCONFIG_CMD_CREATE, None, None, 0) < 0:
            raise RuntimeShimError(f"create overlay on {lower}: "
                                   f"{_os_error('fsconfig').strerror}",
                                   hint="check dmesg for 'overlayfs:' lines")
        mfd = sc(_SYS_FSMOUNT, fsfd, 0, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
        if mfd < 0:
            raise RuntimeShimError(f"fsmount overlay: {_os_error('fsmount').strerror}")
        return mfd
    finally:
        os.close(fsfd)


def _inject(init_pid: int, ops: list[tuple[str, int, int | None]]) -> None:
    """In the mount namespace of ``init_pid``: for each ``(dest, mount fd, old device)``,
    detach what is mounted at ``dest`` if it is the layer of device ``old device``, then
    attach the detached mount there. Done by a forked child: ``setns`` into a mount namespace
    is refused to a multi-threaded process. The child makes only system calls and exits."""
    nsfd = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                if LIBC.setns(nsfd, _CLONE_NEWNS) == 0:  # root and cwd: the sandbox's root
                    code = 0
                    for i, (dest, mfd, old) in enumerate(ops):
                        target = dest.encode()
                        if old is not None and os.stat(target).st_dev == old:
                            raw_umount2(target, MNT_DETACH)
                        if raw_syscall(_SYS_MOVE_MOUNT, mfd, b"", _AT_FDCWD, target,
                                         _MOVE_MOUNT_F_EMPTY_PATH) < 0:
                            code = 2 + i
                            break
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(nsfd)
    code = os.waitstatus_to_exitcode(status)
    if code == 1:
        raise RuntimeShimError(f"join the mount namespace of sandbox process {init_pid}")
    if code != 0:
        dest = ops[code - 2][0] if 2 <= code < 2 + len(ops) else "?"
        raise RuntimeShimError(f"attach the new layer of {dest} in the sandbox (exit {code})")


class FnCallBackend:
    """The ``fncall`` backend (``runtime_shim.backends.base.Backend``)."""

    name = "fncall"

    def check(self, *, keep: bool, seccomp: str | Mapping | None, lazy: bool) -> None:
        if keep:
            raise BackendUnavailable("fncall sandboxes cannot be kept",
                                     hint="they serve stateless calls of one process")

    def create(self, req: CreateRequest) -> FnSandbox:
        return FnSandbox(req)

    def attach(self, paths: SandboxPaths, layout: NodeLayout, lock: ResolvedLock,
               runtime: str) -> FnSandbox:
        raise BackendUnavailable("an fncall sandbox cannot be attached",
                                 hint="it lives as long as the process that created it")

    def remove(self, layout: NodeLayout, sandbox_id: str, runtime: str) -> None:
        destroy(OciRuntime(runtime, state_root=str(layout.runc)), sandbox_id)
