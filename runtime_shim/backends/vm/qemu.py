"""Launching microVMs: a frozen ``VmRequest``, its QEMU argv (pure), and the launcher.

``VmLauncher`` is the seam: ``launch(request, console_log) -> VmProcess``. ``QemuLauncher`` runs
``qemu-system-x86_64 -M microvm``; a Firecracker launcher would implement the same protocol
where its binary exists (none here, so none is written).

Acceleration: KVM when ``/dev/kvm`` accepts this guest, else TCG. ``/dev/kvm`` existing is not
enough (on this machine it is a PVM host module and QEMU fails with MSR errors), so
``probe_kvm`` boots the real kernel once with ``-accel kvm`` and caches the answer in the node
dir (``vm/kvm-probe.json``, keyed by kernel and QEMU). Under TCG the kernel needs
``tsc_early_khz`` (``kernel_cmdline``) or it hangs on TSC calibration.

No orphan VMs: QEMU is spawned with ``PR_SET_PDEATHSIG=SIGKILL``. The kernel sends that signal
when the *thread* that forked the child exits, not the process, so every QEMU is forked by one
long-lived daemon thread (``_Spawner``): a sandbox created in a pool thread survives the
thread, and QEMU still dies with the host process (``kill -9`` included).

Pausing: a VM started with ``VmRequest.qmp_socket`` has a QMP monitor there; ``qmp(path,
"stop")`` halts its vCPUs and, before returning, completes every in-flight disk request, so
the disk images on the host stop changing until ``qmp(path, "cont")`` (the guest's clock stops
too, so it sees no jump).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from envbuild.libc import LIBC
from runtime_shim.isolation import scratchfs

PR_SET_PDEATHSIG = 1
KVM_PROBE_VERSION = 1
#: What a VM's console.log may hold (kernel + init messages are a few KB; the rest is dropped).
CONSOLE_LOG_CAP = 16 << 20


@dataclasses.dataclass(frozen=True)
class Drive:
    path: str
    serial: str  # how the guest init finds it (virtio-blk serial, <= 20 bytes)
    readonly: bool = True


#: Size granularity of a virtio-pmem backing file (the guest maps it in 2 MiB subsections).
PMEM_ALIGN = 2 << 20
#: PCI slot of layer 0's virtio-pmem device on the ``q35`` machine; layer i is at slot
#: ``PMEM_FIRST_SLOT + i`` (the guest init derives the layer from the slot). Other devices get
#: the free slots below (QEMU assigns them after the pmem devices, which come first).
PMEM_FIRST_SLOT = 0x0A
MACHINES = ("microvm", "q35")


@dataclasses.dataclass(frozen=True)
class Pmem:
    """A read-only file mapped into the guest as a virtio-pmem device (``q35`` only)."""

    path: str
    size: int  # bytes, a multiple of PMEM_ALIGN, at most the file's length


@dataclasses.dataclass(frozen=True)
class VmRequest:
    """Everything one VM is made of. ``argv`` for it is ``qemu_argv(request)`` (pure)."""

    kernel: str
    initrd: str
    cmdline: str
    drives: tuple[Drive, ...]
    agent_socket: str | None  # host unix socket of the agent's virtio serial port
    memory_mib: int = 512
    vcpus: int = 1
    accel: str = "tcg"  # "kvm" | "tcg"
    network: bool = False
    # With ``network``: the sandbox's namespace file (``runtime_shim.isolation.netns``); QEMU runs in
    # it, so its user-mode gateway 10.0.2.2 is that namespace's empty loopback, not the host's.
    network_ns: str | None = None
    qemu: str = "qemu-system-x86_64"
    qmp_socket: str | None = None  # host unix socket of a QMP monitor (pause/resume)
    # ``microvm``: virtio-mmio devices, no firmware. ``q35``: virtio-pci devices behind qboot,
    # needed for ``pmem`` (QEMU 7.2's microvm has no device-memory region: a virtio-pmem
    # device there gets guest address 0 and the guest's nd_pmem cannot reserve it).
    machine: str = "microvm"
    pmem: tuple[Pmem, ...] = ()
    balloon: bool = False  # a virtio-balloon with free page reporting
    # ``-incoming`` for a restore: e.g. ``"defer"`` or ``"exec:cat FILE"``; None boots.
    incoming: str | None = None


def qemu_argv(req: VmRequest) -> list[str]:
    """The QEMU command line for ``req``: the machine, no default devices, the console on the
    (inherited) stdout, the layer pmem devices (``q35``), the disks in order, the agent's
    serial port, and a network device only when asked."""
    if req.accel not in ("kvm", "tcg"):
        raise ValueError(f"accel must be kvm or tcg, not {req.accel!r}")
    if req.machine not in MACHINES:
        raise ValueError(f"machine must be one of {MACHINES}, not {req.machine!r}")
    if req.pmem and req.machine != "q35":
        raise ValueError("virtio-pmem devices need the q35 machine")
    # nsenter execs QEMU in the namespace (no fork for --net): the pid stays QEMU's.
    prefix = ["nsenter", f"--net={req.network_ns}", "--"] if req.network_ns else []
    memory = _memory_arg(req)
    machine = (["-M", "microvm"] if req.machine == "microvm" else
               # qboot: a firmware that only loads the kernel (SeaBIOS costs ~1 s under TCG)
               # and without the chipset devices a guest here never uses: ~0.3 s less boot
               ["-M", "q35,hpet=off,smbus=off,sata=off,vmport=off", "-bios", "qboot.rom"])
    argv = [*prefix, req.qemu, *machine, "-accel", req.accel,
            *(["-cpu", "host"] if req.accel == "kvm" else []), "-m", memory,
            "-smp", str(req.vcpus),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-serial", "stdio", "-kernel", req.kernel, "-initrd", req.initrd,
            "-append", req.cmdline]
    return argv + _device_args(req)


def _memory_arg(req: VmRequest) -> str:
    """``-m``: the RAM, and with pmem devices the device-memory region they live in."""
    memory = f"{req.memory_mib}M"
    if req.pmem:
        for p in req.pmem:
            if p.size <= 0 or p.size % PMEM_ALIGN:
                raise ValueError(f"pmem {p.path}: size {p.size} is not a positive multiple of "
                                 f"{PMEM_ALIGN}")
        if len(req.pmem) > 0x1F - PMEM_FIRST_SLOT:
            raise ValueError(f"at most {0x1F - PMEM_FIRST_SLOT} pmem devices")
        # The pmem devices live in the machine's device-memory region, above the RAM.
        total = sum(p.size for p in req.pmem) >> 20
        memory += f",slots={len(req.pmem)},maxmem={req.memory_mib + total}M"
    return memory


def _device_args(req: VmRequest) -> list[str]:
    """The devices of ``req`` in QEMU's order: pmem, disks, agent port, balloon, QMP, network."""
    bus = "pci" if req.machine == "q35" else "device"  # virtio-blk-pci / virtio-blk-device
    argv: list[str] = []
    for i, p in enumerate(req.pmem):  # first: their fixed slots are taken before any other
        argv += ["-object", f"memory-backend-file,id=pm{i},share=on,readonly=on,"
                            f"mem-path={_opt(p.path)},size={p.size}",
                 "-device", f"virtio-pmem-pci,memdev=pm{i},id=pmem{i},"
                            f"addr={PMEM_FIRST_SLOT + i:#04x}"]
    for i, d in enumerate(req.drives):
        if len(d.serial) > 20:
            raise ValueError(f"virtio-blk serial {d.serial!r} is longer than 20 bytes")
        ro = ",readonly=on" if d.readonly else ""
        argv += ["-drive", f"file={_opt(d.path)},format=raw,if=none,id=d{i}{ro}"
                           f",cache={'unsafe' if not d.readonly else 'writeback'}",
                 "-device", f"virtio-blk-{bus},drive=d{i},serial={d.serial}"]
    if req.agent_socket:
        argv += ["-device", f"virtio-serial-{bus}",
                 "-chardev", f"socket,path={_opt(req.agent_socket)},server=on,wait=off,id=agent",
                 "-device", "virtserialport,chardev=agent,name=envbuild.agent"]
    if req.balloon:
        # Free page reporting: the guest hands pages it freed back (QEMU discards them, so
        # the host's RSS drops) without a host-side balloon driver.
        argv += ["-device", f"virtio-balloon-{bus},id=balloon0,free-page-reporting=on"]
    if req.qmp_socket:
        argv += ["-qmp", f"unix:{_opt(req.qmp_socket)},server=on,wait=off"]
    if req.network:
        # User-mode (slirp) networking: outbound TCP/UDP through the stack of the namespace
        # QEMU runs in (the sandbox's own, see network_ns), no inbound ports, guest at
        # 10.0.2.15 behind NAT (see the README's microVM section).
        argv += ["-netdev", "user,id=n0,ipv6=off", "-device", f"virtio-net-{bus},netdev=n0"]
    if req.incoming:
        argv += ["-incoming", req.incoming]
    return argv


def _opt(value: str) -> str:
    """QEMU option values escape ``,`` by doubling it."""
    return value.replace(",", ",,")


QMP_TIMEOUT = 10.0


def qmp(path: str, command: str, arguments: dict | None = None, *,
        timeout: float = QMP_TIMEOUT) -> object:
    """Run one QMP ``command`` (with ``arguments``) on the monitor at ``path``: its ``return``
    value. One connection per call (the monitor takes one client at a time); events are
    skipped."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        lines = _qmp_lines(sock)
        if "QMP" not in next(lines, {}):
            raise RuntimeShimError(f"QMP {command} on {path}: no greeting")
        for cmd, args in (("qmp_capabilities", None), (command, arguments)):
            msg: dict = {"execute": cmd, **({"arguments": args} if args else {})}
            sock.sendall(json.dumps(msg).encode() + b"\n")
            reply = next((m for m in lines if "return" in m or "error" in m), None)
            if reply is None:
                raise RuntimeShimError(f"QMP {cmd} on {path}: the monitor closed the connection")
            if "error" in reply:
                raise RuntimeShimError(f"QMP {cmd} on {path}: "
                                       f"{reply['error'].get('desc', reply['error'])}")
        assert reply is not None  # the loop ran: the reply to ``command``
        return reply["return"]
    except (OSError, ValueError) as e:
        raise RuntimeShimError(f"QMP {command} on {path}: {e}") from e
    finally:
        sock.close()


def wait_migration(path: str, timeout: float, *, poll: float = 0.005) -> dict:
    """Poll ``query-migrate`` until the migration (either direction) completed: its status
    dict; ``RuntimeShimError`` with QEMU's reason when it failed or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        reply = qmp(path, "query-migrate")
        status: dict = reply if isinstance(reply, dict) else {}
        state = status.get("status")
        if state == "completed":
            return status
        if state in ("failed", "cancelled"):
            raise RuntimeShimError(f"migration {state}: "
                                   f"{status.get('error-desc', 'QEMU gave no reason')}")
        if time.monotonic() > deadline:
            raise RuntimeShimError(f"migration did not complete within {timeout:.0f} s "
                                   f"(status {state})")
        time.sleep(poll)
        poll = min(poll * 1.5, 0.05)


def _qmp_lines(sock: socket.socket):
    """The JSON messages the monitor sends, one a line."""
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
        data = sock.recv(65536)
        if not data:
            return
        buf += data


class VmProcess(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class VmLauncher(Protocol):
    """Starts a VM described by a ``VmRequest``; its console goes to ``console_log``."""

    def launch(self, request: VmRequest, console_log: Path) -> VmProcess: ...


class QemuLauncher:
    def __init__(self, qemu: str | None = None) -> None:
        self.qemu = qemu or find_qemu()

    def launch(self, request: VmRequest, console_log: Path) -> subprocess.Popen:
        argv = qemu_argv(dataclasses.replace(request, qemu=self.qemu))
        # Guest root can write to its console forever: the log (a host file) gets at most
        # CONSOLE_LOG_CAP of it, through a pipe and a copier that drops the rest.
        log = open(console_log, "wb")
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            proc = _SPAWNER.spawn(lambda: subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent, close_fds=True))
        except BaseException:
            os.close(read_fd)
            log.close()
            raise
        finally:
            os.close(write_fd)
        threading.Thread(target=scratchfs.copy_capped, args=(read_fd, log, CONSOLE_LOG_CAP),
                         name="vm-console", daemon=True).start()
        return proc


def find_qemu() -> str:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        raise RuntimeShimError("qemu-system-x86_64 is not installed",
                               hint="apt-get install qemu-system-x86 (or run scripts/setup.sh)")
    return path


def qemu_version(qemu: str | None = None) -> str:
    """This QEMU's version line (``-version``), asked once per binary."""
    qemu = qemu or find_qemu()
    return _version(qemu, os.stat(qemu).st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _version(qemu: str, _mtime: int) -> str:
    proc = subprocess.run([qemu, "-version"], capture_output=True, text=True, timeout=30,
                          check=False)
    return (proc.stdout.splitlines() or ["unknown"])[0].strip()


def qemu_devices(qemu: str | None = None) -> frozenset[str]:
    """The device names this QEMU binary offers (``-device help``), asked once per binary."""
    qemu = qemu or find_qemu()
    return _devices(qemu, os.stat(qemu).st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _devices(qemu: str, _mtime: int) -> frozenset[str]:
    try:
        proc = subprocess.run([qemu, "-device", "help"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(re.findall(r'^name "([^"]+)"', proc.stdout + proc.stderr, re.M))


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: only async-signal-safe calls.
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


class _Spawner:
    """One daemon thread that forks every QEMU (see the module docstring for why)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def spawn(self, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="envbuild-vm-spawner",
                                                daemon=True)
                self._thread.start()
        done = threading.Event()
        box: list = []
        self._queue.put((start, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _run(self) -> None:
        while True:
            start, box, done = self._queue.get()
            try:
                box.append(start())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box.append(e)
            done.set()


_SPAWNER = _Spawner()


# ---- KVM probe ---------------------------------------------------------------------------


def choose_accel(node_root: Path, kernel: str, initrd: str, qemu: str | None = None,
                 environ: Mapping[str, str] = os.environ) -> str:
    """``kvm`` if a VM with this kernel really boots under KVM here, else ``tcg``; probed once
    and cached in ``<node_root>/vm/kvm-probe.json``. ``ENVBUILD_VM_ACCEL`` overrides it."""
    forced = environ.get("ENVBUILD_VM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    qemu = qemu or find_qemu()
    key = f"{kernel}|{os.stat(kernel).st_mtime_ns}|{qemu}|{os.stat(qemu).st_mtime_ns}"
    cache = node_root / "vm" / "kvm-probe.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("version") == KVM_PROBE_VERSION and cached.get("key") == key:
            return cached["accel"]
    except (OSError, ValueError):
        pass
    accel = "kvm" if _kvm_boots(qemu, kernel, initrd) else "tcg"
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, json.dumps({"version": KVM_PROBE_VERSION, "key": key, "accel": accel,
                                    "probed": time.time()}))
    return accel


def _kvm_boots(qemu: str, kernel: str, initrd: str) -> bool:
    """Boot the kernel under KVM with an initramfs whose init is missing: the kernel panics
    (``panic=-1`` reboots, ``-no-reboot`` exits) after printing that it ran; QEMU refusing the
    accelerator or the CPU failing shows up as no such line."""
    argv = [qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256M", "-smp", "1",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", "stdio",
            "-kernel", kernel, "-append",
            "console=ttyS0 panic=-1 rdinit=/envbuild-kvm-probe-missing"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=20,
                              preexec_fn=_die_with_parent, check=False)
    except subprocess.TimeoutExpired:
        return False
    out = proc.stdout + proc.stderr
    return b"Kernel panic" in out or b"No working init found" in out
