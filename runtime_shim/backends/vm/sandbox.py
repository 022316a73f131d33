"""``MicroVmSandbox``: one running QEMU microVM of one lock, the handle of the ``microvm``
backend (``runtime_shim.backends.vm.backend``).

One VM is (all under the sandbox's directory, removed on ``close``)::

    console.log       the guest console (kernel + init messages; the ready marker)
    rw.ext4           the writable disk: sparse ext4, ``upper/`` and ``work/`` at its root
    config.sh         the config disk: a shell fragment the init sources (see below)
    agent.sock        QEMU's end of the agent's virtio serial port
    qmp.sock          QEMU's monitor (QMP), to pause the VM for pack-diff
    snapshot-rw/      the writable disk mounted read-only on the host, during pack-diff only

plus, shared by every VM on the host, the EROFS image of each layer
(``<node>/erofs/<hex>.erofs``), the initramfs and the kernel image (``<node>/vm/``).

The VM's devices, disks and options are planned as data in ``runtime_shim.backends.vm.plan``;
this module makes the files they name, runs QEMU and talks to the guest.

Layer transport (``choose_layer_transport``, ``info().layer_transport``): ``pmem-dax`` puts
each layer image on a read-only virtio-pmem device of a ``q35`` machine (virtio-pci devices,
qboot firmware) that the guest mounts ``-o dax``: the guest's file reads and mappings go to
the host's page cache of the image, one copy for every VM. ``virtio-blk`` (``microvm``,
virtio-mmio) is the fallback when the guest kernel or QEMU cannot: each guest then caches its
own copy. Memory: a virtio-balloon with free page reporting (``VmOptions.balloon``) hands
pages the guest frees back to the host; ``memory()`` reports QEMU's share.

Checkpoints (``checkpoint`` / ``MicroVmBackend.restore``, ``runtime_shim.backends.vm.checkpoint``):
QEMU migration of the stopped, disk-frozen VM to a file plus a sparse copy of its disk; a
restore starts QEMU with ``-incoming defer``, checks every file against envbuild's record and
loads the image, then unfreezes the guest's disk.

Disk contract with the guest init (``runtime_shim.backends.vm.initramfs.INIT_SCRIPT``): virtio-blk
disks carry serials ``eb-cfg``, ``eb-rw`` and ``eb-l0`` … ``eb-l<N-1>`` (bottom layer first); the
config disk holds ``EB_LAYERS``, ``EB_HOSTNAME``, ``EB_NET``, ``EB_NOFILE`` and
``set -- KEY=VALUE …`` (the lock's env, the agent's environment), shell-quoted and padded with
newlines.

Exec goes through the exec agent (``runtime_shim.isolation.agent``, protocol in
``runtime_shim/isolation/agent/README.md``), PID 1 of the guest after ``switch_root``, in its serial mode
on the ``envbuild.agent`` virtio serial port; ``runtime_shim.backends.vm.serial.SerialMux`` turns the
line into per-exec connections, so ``exec`` is ``agent.run`` exactly as for containers, a
timeout included (the agent kills the command's process group; the VM lives on).
``read_file``/``write_file`` are execs of the guest's own busybox (``/.envbuild/busybox``, in the
initramfs, outside the overlay) as root: ``cat`` out, ``cat`` in + ``chmod`` + ``chown`` to the lock's
user, parents created, as the container backend does from the host.

pack-diff (``quiesce`` + ``upper_dir``, driven by ``Sandbox.pack_diff`` as for containers):

1. the guest freezes the writable ext4 (``fsfreeze --freeze /.envbuild/rw``, an exec of its
   busybox as root): the kernel blocks new writes, writes back every dirty page, inode and
   the superblock, and waits for the disk, so the on-disk filesystem is one consistent moment
   (the disk has no journal to replay: freezing is what makes it consistent);
2. QMP ``stop`` halts the vCPUs and completes in-flight disk requests: from here nothing
   in the guest, not even a raw write to the block device, changes the image;
3. the host mounts ``rw.ext4`` read-only with ``fuse2fs`` and ``upper_dir()`` is its
   ``upper/``, packed by ``pack_upper`` under the same ``SnapshotPolicy`` as a container's;
4. on the way out, whatever failed: unmount, QMP ``cont``, ``fsfreeze --unfreeze``. The VM
   runs on, as a container does after ``runc resume``.

The image is guest-written data, contents and metadata alike. Its contents are handled as
hostile (the policy; an ``upper`` that is not a real directory is refused, so a symlink cannot
point the packer at the host's own files), and its metadata is parsed in user space by
fuse2fs, never by the host kernel's ext4 driver, which is not hardened against crafted images
(a guest root can write raw blocks to its disk).

Limits: ``Limits.memory_bytes`` is the VM's RAM, ``VmOptions.vcpus`` its CPUs, ``nofile`` the
agent's rlimit; ``pids`` is not enforced inside the guest (the VM's RAM bounds it), nor
``cpus`` (the vCPUs are the limit).

Isolation boundary: the guest's own kernel. The sandbox's syscalls, namespaces, mounts and
ioctls reach the guest kernel, never the host's, so no seccomp profile is applied inside and
``Sandbox.create(seccomp=...)`` does not apply (a profile is refused for ``backend="microvm"``);
QEMU itself runs on the host unfiltered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import shlex
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from envbuild.errors import (
    CheckpointRefused,
    RuntimeShimError,
    SandboxCompromised,
    SandboxStartError,
)
from runtime_shim.backends.base import CheckpointImage
from runtime_shim.backends.vm import checkpoint as ckpt
from runtime_shim.backends.vm import erofs, initramfs, qemu
from runtime_shim.backends.vm import kernel as vmkernel
from runtime_shim.backends.vm.plan import (
    VM_DISK_UNLIMITED,
    VmOptions,
    choose_layer_transport,
    guest_config,
    request_model,
    vm_request,
)
from runtime_shim.backends.vm.serial import SerialMux
from runtime_shim.isolation import (
    agent,
    netns,  # a networked sandbox's own namespace
)
from runtime_shim.isolation.mount import unmount
from runtime_shim.isolation.spec import parse_user
from runtime_shim.node.locks import ResolvedLock
from runtime_shim.node.nodecache import NodeCache

#: Migration capabilities for checkpoints: shared memory (the pmem layer images, file-backed
#: ``share=on``) is not copied into the image; the restoring VM maps the same files.
MIGRATION_CAPS = [{"capability": "x-ignore-shared", "state": True}]
GUEST_BUSYBOX = "/.envbuild/busybox"
READ_FILE_MAX = 256 << 20
# Run by the guest's busybox sh with $B = the busybox, whatever the image contains.
_READ = ('[ -e "$1" ] || { echo "No such file or directory" >&2; exit 1; }; '
         '[ -f "$1" ] || { echo "not a regular file" >&2; exit 1; }; exec $B cat "$1"')
_WRITE = ('d=$($B dirname "$1") && $B mkdir -p "$d" && $B cat >"$1" && $B chmod "$2" "$1" && '
          '$B chown "$3" "$1"')


@dataclasses.dataclass(frozen=True)
class VmMemoryInfo:
    """A microVM's share of the host's memory, in bytes, with the fields of the SDK's
    ``MemoryInfo`` (issue 19): ``rss`` QEMU's anonymous memory (the guest RAM it touched, the
    guest's own page cache included, plus QEMU's and TCG's), ``cache`` 0 (a VM's page cache
    is inside its RAM), ``shared`` the file pages QEMU maps (the pmem layer images: the host
    page cache every VM of those layers shares), ``usage`` its whole RSS, ``reclaimed`` how
    far its RSS is below its peak (what the balloon's free page reporting gave back)."""

    rss: int
    cache: int
    shared: int
    usage: int
    reclaimed: int = 0




class MicroVmSandbox:
    """A running microVM of one lock (see the module docstring): a ``SandboxHandle``,
    ``Snapshottable``."""

    def __init__(self, sandbox_id: str, root: Path, lock: ResolvedLock, node: NodeCache,
                 layer_dirs: Sequence[str], *, network: netns.NetworkPolicy | bool | None, limits,
                 options: VmOptions | None
                 = None, launcher: qemu.VmLauncher | None = None,
                 environ: Mapping[str, str] = os.environ,
                 restore: tuple[ckpt.VmCheckpoint, Path] | None = None) -> None:
        """Boot a VM of ``lock``, or with ``restore=(record, dir)`` start it from that
        checkpoint (``runtime_shim.backends.vm.checkpoint``) without booting: its files are checked
        against the record before QEMU sees them."""
        self.id = sandbox_id
        self.root = root
        self.lock = lock
        self.limits = limits
        self.options = options or VmOptions.from_env(environ)
        self.timings: dict[str, float] = {}
        self._proc: qemu.VmProcess | None = None
        self._mux: SerialMux | None = None
        self.net: netns.NetworkHandle | None = None
        self.console_log = root / "console.log"
        self.agent_socket = root / "agent.sock"
        self.qmp_socket = root / "qmp.sock"
        self.rw_disk = root / "rw.ext4"
        self._snapshot_upper: Path | None = None
        self._quiesced = False
        policy = netns.parse_network(network) if isinstance(network, bool) else network
        t0 = time.monotonic()
        kern, image, initrd, qemu_bin = self._guest_files(node, environ, policy is not None)
        pmem = self.layer_transport == "pmem-dax"
        t1 = time.monotonic()
        images = [erofs.ensure_erofs(node.root, layer.digest, Path(d))
                  for layer, d in zip(lock.layers, layer_dirs)]
        t2 = time.monotonic()
        cfg = root / "config.sh"
        self._write_disks(cfg, len(images), policy is not None, pmem, restore)
        accel = qemu.choose_accel(node.root, str(image), str(initrd), environ=environ)
        self.request = vm_request(
            kernel=image, initrd=initrd,
            cmdline=vmkernel.kernel_cmdline(tsc_khz=vmkernel.host_tsc_khz()), images=images,
            rw=self.rw_disk, cfg=cfg, agent_socket=self.agent_socket, qmp_socket=self.qmp_socket,
            memory_bytes=limits.memory_bytes or self.options.default_memory_bytes,
            options=self.options, accel=accel, network=policy is not None, pmem=pmem,
            incoming=restore is not None)
        self.model, self.model_digest = request_model(
            self.request, lock, network=policy is not None,
            qemu_version=qemu.qemu_version(qemu_bin), kernel_version=kern.version,
            initramfs=initrd.name)
        if restore is not None:
            self._check_restore(*restore)
        t3 = time.monotonic()
        self._start(policy, launcher, restore)
        t4 = time.monotonic()
        self.timings = {"kernel_initramfs": t1 - t0, "erofs": t2 - t1, "disks_and_probe": t3 - t2,
                        "boot": t4 - t3}

    def _guest_files(self, node: NodeCache, environ: Mapping[str, str], network: bool
                     ) -> tuple[vmkernel.GuestKernel, Path, Path, str]:
        """``(kernel, boot image, initramfs, QEMU binary)``, built or found once per host;
        sets the layer transport they allow."""
        kern = vmkernel.find_kernel(environ)
        image = vmkernel.boot_image(node.root, kern)
        qemu_bin = qemu.find_qemu()
        self.layer_transport, self.layer_transport_why = choose_layer_transport(
            self.options.layers, kern, qemu_bin)
        pmem = self.layer_transport == "pmem-dax"
        agent_path = agent.agent_binary(node.root)  # PID 1 of the guest, in serial mode
        initrd = initramfs.ensure_initramfs(node.root, kern, agent_path, network=network,
                                            pmem=pmem, balloon=self.options.balloon)
        return kern, image, initrd, qemu_bin

    def _write_disks(self, cfg: Path, layers: int, network: bool, pmem: bool,
                     restore: tuple[ckpt.VmCheckpoint, Path] | None) -> None:
        """The writable disk and the config disk: new, or the checkpoint's (checked)."""
        if restore is None:
            erofs.make_writable_disk(self.rw_disk, self.options.disk_bytes
                                     or self.limits.disk_bytes or VM_DISK_UNLIMITED,
                                     inodes=self.limits.inodes)
            cfg.write_bytes(guest_config(self.lock, layers=layers, network=network,
                                         nofile=self.limits.nofile, pmem=pmem))
        else:
            record, src = restore
            # checked as copied: what QEMU gets is what was verified
            ckpt.checked_copy(record, src, ckpt.DISK_FILE, self.rw_disk)
            ckpt.checked_copy(record, src, ckpt.CONFIG_FILE, cfg)

    def _start(self, policy: netns.NetworkPolicy | None, launcher: qemu.VmLauncher | None,
               restore: tuple[ckpt.VmCheckpoint, Path] | None) -> None:
        """Run QEMU (in the sandbox's own network namespace, if any) and wait for the guest's
        agent; on a restore, load the image first and unfreeze the disk after. Closed on
        failure."""
        if policy is not None:  # QEMU joins the sandbox's own namespace (runtime_shim.isolation.netns)
            self.net = netns.create(self.root, policy)
            self.request = dataclasses.replace(self.request, network_ns=self.net.path)
        try:
            self._proc = (launcher or qemu.QemuLauncher()).launch(self.request, self.console_log)
            (self.root / "qemu.pid").write_text(str(self._proc.pid))  # for remove() from elsewhere
        except BaseException:
            self.close()
            raise
        try:
            if restore is not None:
                self._incoming(*restore)
            self.guest_ready_at = self._wait_ready(
                first_channel=restore[0].next_channel if restore else 1)
            if restore is not None:
                self._fsfreeze("unfreeze")  # the image is of a frozen guest (checkpoint())
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else 0

    @property
    def host_pid(self) -> int | None:
        """``backends.base.HostProcess``: the VM's QEMU."""
        return self.pid

    def memory(self) -> VmMemoryInfo | None:
        """What this VM holds of the host's memory, from its QEMU's ``/proc/PID/status``
        (``runtime_shim.backends.base.MemoryReporting``); None once it stopped."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{self._proc.pid}/status").read_text()
        except OSError:
            return None
        kb = {k: int(v.split()[0]) << 10 for k, _, v in
              (line.partition(":") for line in status.splitlines())
              if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")}
        return VmMemoryInfo(rss=kb.get("RssAnon", 0), cache=0,
                            shared=kb.get("RssFile", 0) + kb.get("RssShmem", 0),
                            usage=kb.get("VmRSS", 0),
                            reclaimed=max(0, kb.get("VmHWM", 0) - kb.get("VmRSS", 0)))

    def describe(self) -> dict[str, object]:
        """What ``Sandbox.info()`` reports of this VM beyond the common record
        (``runtime_shim.backends.base.Describable``)."""
        return {"layer_transport": self.layer_transport,
                "layer_transport_why": self.layer_transport_why,
                "machine": self.request.machine, "accel": self.request.accel,
                "balloon": self.request.balloon}

    def _check_restore(self, record: ckpt.VmCheckpoint, src: Path) -> None:
        """Refuse a checkpoint whose device model or memory image is not the recorded one."""
        if record.device_model != self.model_digest:
            diff = sorted(k for k in self.model if self.model.get(k) != record.model.get(k))
            raise CheckpointRefused(
                "restore microVM checkpoint: this VM's devices differ from the checkpoint's",
                context=f"differs in: {', '.join(diff) or 'the recorded model itself'}",
                hint="restore with the same limits, network and kernel it was saved with")
        ckpt.checked_copy(record, src, ckpt.MEMORY_FILE, None)

    def _incoming(self, record: ckpt.VmCheckpoint, src: Path) -> None:
        """Load the memory image into the QEMU started with ``-incoming defer``."""
        path = str(self.qmp_socket)
        deadline = time.monotonic() + 10
        while True:  # the socket file appears a moment before QEMU listens on it
            try:
                qemu.qmp(path, "query-status")
                break
            except RuntimeShimError:
                if self._proc is None or self._proc.poll() is not None or \
                        time.monotonic() > deadline:
                    raise SandboxStartError(
                        f"restore microVM {self.id}: QEMU did not start",
                        context=self._console().decode(errors="replace")[-3000:]) from None
                time.sleep(0.002)
        qemu.qmp(path, "migrate-set-capabilities", {"capabilities": MIGRATION_CAPS})
        mem = src / ckpt.MEMORY_FILE
        qemu.qmp(path, "migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(mem))}"})
        try:
            qemu.wait_migration(path, self.options.boot_timeout)
        except RuntimeShimError as e:
            raise SandboxStartError(f"restore microVM {self.id}: {e.message}",
                                    context=self._console().decode(errors="replace")[-3000:]
                                    ) from None
        status = qemu.qmp(path, "query-status")
        if isinstance(status, dict) and status.get("status") != "running":
            qemu.qmp(path, "cont")

    def checkpoint(self, dest_dir: Path, *, leave_running: bool = False) -> CheckpointImage:
        """Save this VM into ``dest_dir`` (empty or new; ``runtime_shim.backends.vm.checkpoint``): a
        ``CheckpointImage`` of kind ``qemu`` whose ``record`` is the ``VmCheckpoint``
        (``runtime_shim.backends.base.Checkpointable``). Inside ``quiesce()`` (as the SDK calls it)
        the guest is already frozen and stopped; outside, this freezes and stops it itself.
        Without ``leave_running`` the VM is gone on return; with it, it runs on (after
        ``quiesce`` when called inside it). On failure the VM runs on and the files made
        here are removed."""
        if self._proc is None or self._proc.poll() is not None or self._mux is None:
            raise RuntimeShimError(f"microVM {self.id} is not running")
        started = time.monotonic()
        dest = Path(dest_dir)
        dest.mkdir(mode=0o700, exist_ok=True)
        if any(dest.iterdir()):
            raise RuntimeShimError(f"checkpoint microVM {self.id}: {dest} is not empty")
        path = str(self.qmp_socket)
        resume: list = []
        ok = False
        try:
            if not self._quiesced:
                self._fsfreeze("freeze")
                resume.append(lambda: self._fsfreeze("unfreeze"))
                qemu.qmp(path, "stop")
                resume.append(lambda: qemu.qmp(path, "cont"))
            channel = self._mux.next_channel  # after the freeze exec: no exec is under way
            qemu.qmp(path, "migrate-set-capabilities", {"capabilities": MIGRATION_CAPS})
            # QEMU's default cap is 32 MiB/s; the VM is stopped, so go as fast as the disk.
            qemu.qmp(path, "migrate-set-parameters", {"max-bandwidth": 1 << 40})
            mem = dest / ckpt.MEMORY_FILE
            qemu.qmp(path, "migrate", {"uri": f"exec:cat > {shlex.quote(str(mem))}"})
            qemu.wait_migration(path, 600)
            files = {ckpt.MEMORY_FILE: ckpt.file_digest(mem),
                     ckpt.DISK_FILE: ckpt.pack_sparse(self.rw_disk, dest / ckpt.DISK_FILE),
                     ckpt.CONFIG_FILE: ckpt.sparse_copy(self.root / "config.sh",
                                                        dest / ckpt.CONFIG_FILE)}
            record = ckpt.VmCheckpoint(lock=self.lock.digest, device_model=self.model_digest,
                                       model=self.model, files=files, next_channel=channel,
                                       seconds=time.monotonic() - started)
            (dest / ckpt.RECORD_FILE).write_text(record.to_json())  # a copy, for people
            ok = True
        finally:
            if not ok:
                for name in (ckpt.MEMORY_FILE, ckpt.DISK_FILE, ckpt.CONFIG_FILE):
                    (dest / name).unlink(missing_ok=True)
            if ok and not leave_running:
                self.close()
            else:
                for undo in reversed(resume):
                    undo()
        # what the files take (the disk is packed: its non-zero blocks only)
        size = sum((dest / name).stat().st_size for name in files)
        return CheckpointImage(kind="qemu", dir=dest, record=record.to_record(), bytes=size,
                               seconds=record.seconds)

    def _wait_ready(self, first_channel: int = 1) -> float:
        """Connect to the agent's serial socket and wait for its HELLO on a first channel,
        watching the console for the init failing and QEMU for exiting. Returns the guest
        uptime at which the init handed over (from its ready line), or 0."""
        assert self._proc is not None  # launched by start()
        deadline = time.monotonic() + self.options.boot_timeout
        delay = 0.002
        probe: socket.socket | None = None
        reply = b""
        while True:
            if self._mux is None and self.agent_socket.exists():
                line = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                try:
                    line.connect(str(self.agent_socket))
                except OSError:
                    line.close()
                else:
                    self._mux = SerialMux(line, first_channel)
                    probe = self._mux.connect()
                    probe.setblocking(False)
                    probe.sendall(agent.frame(agent.T_HELLO,
                                              agent.PROTOCOL_VERSION.to_bytes(4, "big")))
            if probe is not None:
                try:
                    reply += probe.recv(4096)
                except BlockingIOError:
                    pass
                if len(reply) >= 9:
                    probe.close()
                    self._check_hello(reply)
                    return self._ready_uptime()
            log = self._console()
            failed = initramfs.FAILED_MARKER in log
            exited = self._proc.poll() is not None
            if failed or exited or time.monotonic() > deadline or (self._mux and self._mux.error):
                why = ("the guest init failed" if failed else
                       f"QEMU exited {self._proc.poll()}" if exited else
                       f"the agent's line broke: {self._mux.error}" if self._mux and
                       self._mux.error else
                       f"the guest agent did not answer within {self.options.boot_timeout:.0f} s")
                if probe is not None:
                    probe.close()
                raise SandboxStartError(f"start microVM {self.id}: {why}",
                                        context=log.decode(errors="replace").strip()[-3000:],
                                        hint="see console.log in the sandbox directory")
            if probe is not None:  # wake on the agent's reply, not at the next tick
                select.select([probe], [], [], delay)
            else:
                time.sleep(delay)
            delay = min(delay * 1.5, 0.02)

    def _check_hello(self, reply: bytes) -> None:
        try:
            agent.check_hello(reply)
        except SandboxCompromised:
            raise
        except RuntimeShimError as e:
            raise SandboxStartError(f"start microVM {self.id}: the guest agent {e}") from None

    def _console(self) -> bytes:
        try:
            return self.console_log.read_bytes()
        except FileNotFoundError:
            return b""

    def _ready_uptime(self) -> float:
        log = self._console()
        i = log.find(initramfs.READY_MARKER)
        try:
            return float(log[i:log.index(b"\n", i)].split()[-1]) if i >= 0 else 0.0
        except (ValueError, IndexError):
            return 0.0

    # ---- Backend protocol ---------------------------------------------------------------

    def exec(self, req: agent.ExecRequest, *, on_stdout: agent.OutputCallback | None = None,
             on_stderr: agent.OutputCallback | None = None) -> agent.ExecOutcome:
        return agent.run(self._connect, req, self.limits.output_bytes,
                         deadline=self.limits.exec_timeout, on_stdout=on_stdout,
                         on_stderr=on_stderr)

    def _connect(self) -> socket.socket:
        if self._mux is None:
            raise RuntimeShimError(f"microVM {self.id} is not running")
        return self._mux.connect()

    connect = _connect

    def _root_exec(self, script: str, args: Sequence[str], stdin: bytes | None = None,
                   cap: int = 1 << 20) -> agent.ExecOutcome:
        req = agent.ExecRequest(argv=(GUEST_BUSYBOX, "sh", "-c", script, "sh", *args),
                                env={"B": GUEST_BUSYBOX}, cwd="/", user="0:0",
                                timeout=60.0, stdin=stdin if stdin is not None else b"")
        return agent.run(self._connect, req, cap)

    def read_file(self, path: str) -> bytes:
        done = self._root_exec(_READ, ["/" + path.lstrip("/")], cap=READ_FILE_MAX)
        if done.exit_code != 0 or done.output_truncated:
            why = done.stderr.decode(errors="replace").strip() or f"exit {done.exit_code}"
            if done.output_truncated:
                why = f"over the {READ_FILE_MAX}-byte limit"
            raise RuntimeShimError(f"read {path} in sandbox: {why}")
        return done.stdout

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        uid, gid = parse_user(self.lock.user)
        done = self._root_exec(_WRITE, ["/" + path.lstrip("/"), f"{mode:o}", f"{uid}:{gid}"],
                               stdin=data)
        if done.exit_code != 0:
            why = done.stderr.decode(errors="replace").strip() or f"exit {done.exit_code}"
            raise RuntimeShimError(f"write {path} in sandbox: {why}")

    # ---- pack-diff (see the module docstring) -----------------------------------------------

    def upper_dir(self) -> Path:
        if self._snapshot_upper is None:
            raise RuntimeShimError(f"the upper dir of microVM {self.id} is readable only "
                                   "inside quiesce()")
        return self._snapshot_upper

    @contextlib.contextmanager
    def quiesce(self) -> Iterator[None]:
        """Freeze the guest's writable disk, pause the VM and mount the disk read-only on the
        host for ``upper_dir()``; undo all three on exit, whatever failed."""
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeShimError(f"microVM {self.id} is not running")
        mnt = self.root / "snapshot-rw"
        with contextlib.ExitStack() as undo:
            self._fsfreeze("freeze")
            # a checkpoint() inside without leave_running has closed the VM: nothing to resume
            undo.callback(self._if_running, self._fsfreeze, "unfreeze")
            qemu.qmp(str(self.qmp_socket), "stop")
            undo.callback(self._if_running, qemu.qmp, str(self.qmp_socket), "cont")
            self._quiesced = True
            undo.callback(setattr, self, "_quiesced", False)
            mnt.mkdir()
            undo.callback(mnt.rmdir)
            erofs.mount_writable_disk(self.rw_disk, mnt)
            undo.callback(unmount, str(mnt))
            self._snapshot_upper = _real_dir(mnt / "upper")
            undo.callback(setattr, self, "_snapshot_upper", None)
            yield

    def _if_running(self, fn, *args) -> None:
        if self._proc is not None and self._proc.poll() is None:
            fn(*args)

    def _fsfreeze(self, how: str) -> None:
        done = self._root_exec('exec $B fsfreeze "--$1" "$2"', [how, initramfs.GUEST_RW_MOUNT])
        if done.exit_code != 0:
            why = done.stderr.decode(errors="replace").strip() or f"exit {done.exit_code}"
            raise RuntimeShimError(f"{how} the writable disk of microVM {self.id}: {why}",
                                   hint=None if how == "freeze" else
                                   "the guest's writes to its disk stay blocked; close it")

    def close(self) -> None:
        mux, self._mux = getattr(self, "_mux", None), None
        if mux is not None:
            mux.close()
        proc, self._proc = self._proc, None
        if proc is None:
            self._close_network()
            return
        if proc.poll() is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        self._close_network()

    def _close_network(self) -> None:
        net, self.net = getattr(self, "net", None), None
        if net is not None:
            net.close()


def _real_dir(path: Path) -> Path:
    """``path`` if it is a directory and not a symlink (the guest chose what it is)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise RuntimeShimError(f"read the sandbox's changes: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeShimError("read the sandbox's changes: upper/ on the writable disk is "
                               "not a directory", hint="was the guest's disk tampered with?")
    return path


__all__ = ["GUEST_BUSYBOX", "MIGRATION_CAPS", "READ_FILE_MAX", "MicroVmSandbox", "VmMemoryInfo"]
