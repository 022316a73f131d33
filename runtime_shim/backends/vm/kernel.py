"""The guest kernel: find it, make the image QEMU boots fastest, and list the modules to load.

The guest runs Debian's ``linux-image-cloud-amd64`` kernel, taken from the host's ``/boot``
(``vmlinuz-<version>``, with its modules in ``/lib/modules/<version>/``) or from the path in
``ENVBUILD_VM_KERNEL``. Installing that package on a host only adds files there; the host keeps
running its own kernel.

QEMU boots the uncompressed ``vmlinux`` (ELF with a PVH note) faster than the ``bzImage``,
which would decompress itself under emulation, so ``boot_image`` extracts it once per kernel
into ``<cache>/vm/kernel/<key>/vmlinux`` (falls back to the ``vmlinuz`` when it cannot).

The modules the guest needs (virtio-mmio, virtio-blk, erofs, overlay, virtio-console; ext4 is
built into the cloud kernel) are resolved with their dependencies from ``modules.dep``, in the
order ``insmod`` must load them (``module_load_order``, pure).
"""

from __future__ import annotations

import dataclasses
import hashlib
import lzma
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError

#: Modules the guest init loads (dependencies are added by ``module_load_order``).
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "erofs", "overlay", "ext4", "virtio_console")
#: Added when the sandbox has a network device.
NET_MODULES = ("virtio_net",)
#: Added for layers on virtio-pmem (the q35 machine: virtio-pci devices, nvdimm's pmem driver).
PMEM_MODULES = ("virtio_pci", "virtio_pmem", "nd_pmem")
#: Added for a memory balloon with free page reporting.
BALLOON_MODULES = ("virtio_balloon",)
KERNEL_ENV = "ENVBUILD_VM_KERNEL"
_VMLINUZ = re.compile(r"vmlinu[xz]-(?P<version>.+)")
# bzImage payload magics, as extract-vmlinux (linux/scripts) looks for them.
_MAGICS = (("lz4", b"\x02\x21\x4c\x18"), ("zstd", b"\x28\xb5\x2f\xfd"),
           ("xz", b"\xfd7zXZ\x00"), ("gzip", b"\x1f\x8b\x08"))


@dataclasses.dataclass(frozen=True)
class GuestKernel:
    path: Path  # vmlinuz-<version> (or vmlinux-<version>)
    version: str
    modules_dir: Path  # /lib/modules/<version>


def find_kernel(environ: Mapping[str, str], boot_dir: str = "/boot",
                modules_root: str = "/lib/modules") -> GuestKernel:
    """``ENVBUILD_VM_KERNEL`` if set, else the newest ``/boot/vmlinuz-*-cloud-amd64``."""
    explicit = environ.get(KERNEL_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise RuntimeShimError(f"{KERNEL_ENV}={explicit}: no such file")
        candidates = [path]
    else:
        candidates = sorted(Path(boot_dir).glob("vmlinuz-*-cloud-amd64"),
                            key=lambda p: _version_key(p.name))
        if not candidates:
            raise RuntimeShimError(
                f"no guest kernel: no {boot_dir}/vmlinuz-*-cloud-amd64",
                hint=f"apt-get install linux-image-cloud-amd64 (scripts/setup.sh does), or set "
                     f"{KERNEL_ENV} to a vmlinuz-<version> whose modules are in "
                     f"{modules_root}/<version>")
    path = candidates[-1]
    m = _VMLINUZ.fullmatch(path.name)
    if not m:
        raise RuntimeShimError(f"guest kernel {path}: cannot tell its version from the name",
                               hint="name it vmlinuz-<version> (as in /boot)")
    modules_dir = Path(modules_root) / m["version"]
    if not (modules_dir / "modules.dep").is_file():
        raise RuntimeShimError(f"guest kernel {path}: no modules in {modules_dir}",
                               hint="install the kernel's package (its modules come with it)")
    return GuestKernel(path, m["version"], modules_dir)


def _version_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# ---- modules (pure) ----------------------------------------------------------------------


def module_name(path: str) -> str:
    """``kernel/fs/erofs/erofs.ko.xz`` → ``erofs`` (dashes and underscores are the same)."""
    base = path.rsplit("/", 1)[-1]
    base = base.split(".ko", 1)[0]
    return base.replace("-", "_")


def module_load_order(modules_dep: str, wanted: Iterable[str],
                      builtin: Iterable[str] = ()) -> list[str]:
    """Paths (relative to the modules dir) to ``insmod`` so that every module comes after
    its dependencies; built-in modules are skipped. ``modules_dep`` is ``modules.dep``'s text,
    ``builtin`` the names in ``modules.builtin``."""
    deps: dict[str, tuple[str, list[str]]] = {}
    for line in modules_dep.splitlines():
        if ":" not in line:
            continue
        path, _, rest = line.partition(":")
        deps[module_name(path)] = (path, [module_name(d) for d in rest.split()])
    built_in = {module_name(b) for b in builtin}
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in seen or name in built_in:
            return
        if name in chain:
            raise RuntimeShimError(f"kernel modules: dependency cycle {' -> '.join(chain)}")
        if name not in deps:
            raise RuntimeShimError(f"kernel module {name!r} is neither in modules.dep nor "
                                   f"built in", hint="use a linux-image-cloud-amd64 kernel")
        path, requires = deps[name]
        for d in requires:
            visit(d, (*chain, name))
        seen.add(name)
        order.append(path)

    for w in wanted:
        visit(module_name(w), ())
    return order


def guest_modules(kernel: GuestKernel, *, network: bool = False, pmem: bool = False,
                  balloon: bool = False) -> list[tuple[str, bytes]]:
    """``(name.ko, uncompressed bytes)`` in load order, read from the kernel's modules dir.
    Signatures are stripped unless the kernel enforces them (``signatures_enforced``)."""
    dep = (kernel.modules_dir / "modules.dep").read_text()
    builtin_file = kernel.modules_dir / "modules.builtin"
    builtin = builtin_file.read_text().split() if builtin_file.is_file() else ()
    wanted = (*GUEST_MODULES, *(NET_MODULES if network else ()),
              *(PMEM_MODULES if pmem else ()), *(BALLOON_MODULES if balloon else ()))
    strip = not signatures_enforced(kernel)
    out = []
    for rel in module_load_order(dep, wanted, builtin):
        data = _decompress_module(rel, (kernel.modules_dir / rel).read_bytes())
        out.append((module_name(rel) + ".ko", strip_signature(data) if strip else data))
    return out


#: What ``scripts/sign-file`` appends after a module's PKCS#7 signature (linux/module_signature.h).
MODULE_SIG_MAGIC = b"~Module signature appended~\n"


def strip_signature(module: bytes) -> bytes:
    """``module`` without its appended signature (pure). The guest kernel verifies a signature
    in software on every load, ~45 ms for the guest's eight modules under TCG; unsigned, they
    load the same (the kernel notes a taint) unless it enforces signatures."""
    if not module.endswith(MODULE_SIG_MAGIC):
        return module
    # struct module_signature (12 bytes, sig_len big-endian last) precedes the magic.
    end = len(module) - len(MODULE_SIG_MAGIC)
    sig_len = int.from_bytes(module[end - 4:end], "big")
    start = end - 12 - sig_len
    return module[:start] if start > 0 else module


def signatures_enforced(kernel: GuestKernel) -> bool:
    """Whether ``kernel`` refuses unsigned modules, from its ``config-<version>`` next to it;
    True (keep the signatures) when that file is missing. Lockdown, the other way to enforce
    them, is on only under EFI Secure Boot, which a microvm does not have."""
    try:
        config = (kernel.path.parent / f"config-{kernel.version}").read_text()
    except OSError:
        return True
    return re.search(r"^CONFIG_MODULE_SIG_FORCE=y$", config, re.M) is not None


def kernel_config(kernel: GuestKernel) -> str | None:
    """The kernel's build configuration (``config-<version>`` next to it), or None."""
    try:
        return (kernel.path.parent / f"config-{kernel.version}").read_text()
    except OSError:
        return None


#: What EROFS on virtio-pmem mounted ``-o dax`` needs of the guest kernel (its config).
PMEM_DAX_CONFIG = (("CONFIG_FS_DAX", "y"), ("CONFIG_VIRTIO_PMEM", "ym"),
                   ("CONFIG_LIBNVDIMM", "ym"), ("CONFIG_BLK_DEV_PMEM", "ym"),
                   ("CONFIG_VIRTIO_PCI", "ym"), ("CONFIG_ZONE_DEVICE", "y"))


def pmem_dax_missing(kernel: GuestKernel) -> str | None:
    """Why ``kernel`` cannot mount its layers from virtio-pmem with DAX, or None if it can:
    its config must have ``PMEM_DAX_CONFIG`` and its modules dir the ``PMEM_MODULES``. EROFS
    has DAX from Linux 5.15 on."""
    config = kernel_config(kernel)
    if config is None:
        return f"no config-{kernel.version} next to the kernel to check for DAX support"
    for name, values in PMEM_DAX_CONFIG:
        m = re.search(rf"^{name}=([ym])$", config, re.M)
        if m is None or m[1] not in values:
            return f"the guest kernel lacks {name}"
    m = re.match(r"(\d+)\.(\d+)", kernel.version)
    if m is None or (int(m[1]), int(m[2])) < (5, 15):
        return f"the guest kernel {kernel.version} predates EROFS DAX (5.15)"
    dep = (kernel.modules_dir / "modules.dep").read_text()
    builtin_file = kernel.modules_dir / "modules.builtin"
    builtin = builtin_file.read_text().split() if builtin_file.is_file() else ()
    try:
        module_load_order(dep, PMEM_MODULES, builtin)
    except RuntimeShimError as e:
        return e.message
    return None


def _decompress_module(name: str, data: bytes) -> bytes:
    if name.endswith(".xz"):
        return lzma.decompress(data)
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if name.endswith(".gz"):
        import gzip

        return gzip.decompress(data)
    return data


# ---- the boot image ----------------------------------------------------------------------


def boot_image(cache_dir: str | os.PathLike[str], kernel: GuestKernel) -> Path:
    """The uncompressed ``vmlinux`` of ``kernel`` (cached), or its ``vmlinuz`` when the
    payload cannot be extracted here."""
    st = kernel.path.stat()
    # Keyed on the file's identity, not its bytes: hashing 14 MB on every start costs ~12 ms.
    key = hashlib.sha256(f"envbuild.vmlinux.v1|{kernel.path}|{st.st_size}|{st.st_mtime_ns}"
                         .encode()).hexdigest()[:16]
    target = Path(cache_dir) / "vm" / "kernel" / key / "vmlinux"
    if target.is_file():
        return target
    if _is_elf(kernel.path):
        return kernel.path
    data = extract_vmlinux(kernel.path.read_bytes())
    if data is None:
        return kernel.path
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, data)
    return target


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def extract_vmlinux(bzimage: bytes) -> bytes | None:
    """The ELF kernel inside a bzImage, or None. Tries each compression magic at each offset
    it occurs (as ``extract-vmlinux`` does) and keeps the first result that is an ELF."""
    for kind, magic in _MAGICS:
        start = bzimage.find(magic)
        while start >= 0:
            out = _try_decompress(kind, bzimage[start:])
            if out is not None and out[:4] == b"\x7fELF":
                return out
            start = bzimage.find(magic, start + 1)
    return None


def _try_decompress(kind: str, data: bytes) -> bytes | None:
    try:
        if kind == "gzip":
            import zlib

            return zlib.decompressobj(31).decompress(data)
        if kind == "xz":
            return lzma.LZMADecompressor().decompress(data)
        if kind == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        if kind == "lz4":  # the kernel's legacy lz4 framing: no Python module reads it
            lz4 = shutil.which("lz4")
            if lz4 is None:
                return None
            # Trailing bytes after the stream make lz4 exit 1 after writing the output.
            proc = subprocess.run([lz4, "-dc"], input=data, capture_output=True, check=False)
            return proc.stdout or None
    except Exception:  # noqa: BLE001 - a false magic match; try the next one
        return None
    return None


def kernel_cmdline(*, tsc_khz: int = 2_000_000, extra: Sequence[str] = ()) -> str:
    """The guest kernel's command line (pure). ``tsc_early_khz`` keeps a TCG microvm from
    hanging in TSC calibration (MACHINE-NOTES.md); it must be the *host's* TSC rate, which
    TCG's ``rdtsc`` passes through, or the guest's clock runs fast or slow (2 GHz on a 2.6 GHz
    host made a 1 s exec timeout fire after 0.77 s). The rest trims boot time and noise."""
    args = ["console=ttyS0", "quiet", "panic=-1", "reboot=t", f"tsc_early_khz={int(tsc_khz)}",
            "tsc=reliable", "no_timer_check", "i8042.noaux", "i8042.nokbd", "8250.nr_uarts=1",
            "random.trust_cpu=on", "rdinit=/init", *extra]
    return " ".join(args)


def host_tsc_khz(cpuinfo: str | None = None) -> int:
    """The host's TSC rate in kHz from ``/proc/cpuinfo``'s ``cpu MHz`` (the kernel's detected
    TSC frequency on x86), or 2 GHz when it is not there."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    m = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", cpuinfo, re.M)
    return int(float(m[1]) * 1000) if m else 2_000_000
