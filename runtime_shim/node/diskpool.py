"""Where a sandbox's writable dirs live and what caps them: the node's disk pool, one btrfs
subvolume per sandbox (the default), or a loop-mounted ext4 per sandbox.

``ENVBUILD_SANDBOX_DISK`` chooses: ``pool`` (default; ``runtime_shim.isolation.quotafs``) or
``loop`` (``runtime_shim.isolation.scratchfs``, the mechanism before issue 39; builds keep it).
FnCall sandboxes always get a loop disk (``POOL_BACKENDS`` says why). Either way
``SandboxPaths.disk`` holds the sandbox's upper, work and ``/tmp`` dirs, capped at
``Limits.disk_bytes``; with ``disk_bytes=None`` neither applies (plain dirs, uncapped).

The pool (``NodeLayout.disk_pool``)::

    pool.img   a sparse btrfs image, made on first use (``ENVBUILD_DISK_POOL_SIZE``, default
               a quarter of the node's disk budget then) and reserved once in the node's ledger
               (key ``pool:sandboxes``, ``runtime_shim.node.admission``)
    mnt/       its mount (one loop device for the node), while it holds a subvolume: the close
               that deletes the last one waits for the kernel's cleaner, removes the quota
               groups the deleted subvolumes left, trims the image (``_release``) and
               unmounts it (the image stays, ~1 MiB allocated; mounting it again costs ~2 ms,
               unless the last instance is not released yet: then a new image), so a node
               with no sandboxes holds no mount, no loop device and no stale quota group
    loop       the loop device of the last mount (``quotafs.still_attached``)
    mnt/<id>   a sandbox's subvolume, capped by its quota group; ``SandboxPaths.disk`` is a
               symlink to it, written before the subvolume exists, so every cleanup that finds
               the sandbox's dir finds its subvolume too
    lock       ``flock``ed while the pool is mounted, a subvolume made, or one deleted and the
               pool perhaps unmounted

``ENVBUILD_DISK_POOL_DIR`` names an operator's own pool instead: a directory on a btrfs with
quotas on (``btrfs quota enable --simple``), checked at each create (one ``statfs``); the
node never mounts, unmounts nor reserves it.

Accounting (``docs/disk-pool.md`` says why): **overcommit within the pool.** A pooled
sandbox's ledger reservation has no disk; the pool's size is reserved once, against the
node filesystem's free space, and bounds what all sandboxes together can write; a sandbox is
admitted while the pool has at least ``min(Limits.disk_bytes, POOL_HEADROOM)`` free (its
actual use, ``statvfs``), and refused with one line (``AdmissionRefused``) otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from envbuild.errors import AdmissionRefused, RuntimeShimError, SettingsError
from runtime_shim.isolation import quotafs, scratchfs
from runtime_shim.isolation.mount import unmount
from runtime_shim.node.admission import (
    BudgetSettings,
    Reservation,
    node_budget,
    read_host,
)
from runtime_shim.node.layout import NodeLayout, SandboxPaths

MODE_ENV = "ENVBUILD_SANDBOX_DISK"
POOL_DIR_ENV = "ENVBUILD_DISK_POOL_DIR"
POOL_SIZE_ENV = "ENVBUILD_DISK_POOL_SIZE"
MODES = ("pool", "loop")
POOL_KEY = "pool:sandboxes"
IMAGE_NAME = "pool.img"
#: A sandbox is admitted while the pool has this much free (or its whole cap, if smaller).
POOL_HEADROOM = 1 << 30
#: How long the close that empties the pool retries its unmount while it is busy.
UNMOUNT_PATIENCE = 0.5
#: How long the close that empties the pool waits for the kernel's cleaner to drop the deleted
#: subvolumes before it trims the pool (what it has not freed by then is trimmed next time).
CLEANER_PATIENCE = 2.0
#: The close that empties the pool trims it when its image holds more than this (a trim
#: costs 40-85 ms with 200 MiB to give back, 0.4-16 ms with nothing: not worth it below).
TRIM_ABOVE = 64 << 20
#: The backends whose sandboxes take their disk from the pool. FnCall keeps a loop disk each:
#: ``statfs`` of the pool shows every sandbox's writes (and a previous tenant's, freed in the
#: background), which ``tests/security/test_fncall_tenants.py`` rightly counts as a channel
#: between the tenants of one FnCall sandbox.
POOL_BACKENDS = ("container",)
#: The default pool's share of the node's disk budget when it is made.
DEFAULT_POOL_SHARE = 0.25


def mode(environ: Mapping[str, str]) -> str:
    """``pool`` or ``loop`` (``ENVBUILD_SANDBOX_DISK``); ``SettingsError`` for anything else."""
    value = environ.get(MODE_ENV, "").strip() or "pool"
    if value not in MODES:
        raise SettingsError(f"{MODE_ENV}: not a disk mode: {value!r}",
                            hint="pool (one btrfs for all sandboxes) or loop (a disk each)")
    return value


def pooled(limits, environ: Mapping[str, str], backend: str = "container") -> bool:
    """Whether a sandbox of ``limits`` on ``backend`` gets its disk from the pool."""
    return (limits.disk_bytes is not None and backend in POOL_BACKENDS
            and mode(environ) == "pool")


def create_disk(layout: NodeLayout, paths: SandboxPaths, limits, *, template_root: Path,
                backend: str, environ: Mapping[str, str] = os.environ) -> None:
    """Give the sandbox at ``paths`` its capped disk at ``paths.disk`` (nothing when
    ``limits.disk_bytes`` is None). On failure ``destroy_disk`` leaves nothing."""
    if limits.disk_bytes is None:
        return
    if not pooled(limits, environ, backend):
        scratchfs.create(paths.root, limits.disk_bytes, limits.inodes,
                         template_root=template_root)
        return
    own = not environ.get(POOL_DIR_ENV, "").strip()
    pool = _mount_dir(layout) if own else Path(environ[POOL_DIR_ENV].strip())
    os.symlink(pool / paths.id, paths.disk)  # first: a cleanup that finds the dir finds it
    try:
        with _pool_lock(layout) if own else contextlib.nullcontext():
            if own:
                _ensure_mounted(layout, environ)
            else:
                quotafs.check_pool(pool)
            _check_room(pool, limits.disk_bytes)
            quotafs.create(pool, paths.id, limits.disk_bytes)
    except BaseException:
        destroy_disk(paths)
        raise


def destroy_disk(paths: SandboxPaths) -> None:
    """Delete the sandbox's disk, whichever kind it has; idempotent. The node's own pool is
    unmounted when this deleted its last subvolume."""
    disk = paths.disk
    if not disk.is_symlink():
        scratchfs.destroy(paths.root)
        return
    target = Path(os.readlink(disk))
    layout = NodeLayout(paths.root.parent.parent)
    own = target.parent == _mount_dir(layout)
    with _pool_lock(layout) if own else contextlib.nullcontext():
        if own and not os.path.ismount(target.parent):
            # a subvolume left in an unmounted pool (a reboot, a crash) is still there
            _mount(layout, create=False)
        if target.name == paths.id:  # never delete what this sandbox's link did not name
            quotafs.destroy(target)
        disk.unlink()
        if own:
            _unmount_if_empty(target.parent)


def _ensure_mounted(layout: NodeLayout, environ: Mapping[str, str]) -> None:
    """Mount the node's pool, making it first if there is none (under the pool's lock)."""
    if not os.path.ismount(_mount_dir(layout)):
        _mount(layout, create=True, environ=environ)


def _mount(layout: NodeLayout, *, create: bool, environ: Mapping[str, str] = os.environ
           ) -> None:
    """Mount the pool's image (under the pool's lock), never one whose last instance is not
    released yet (``quotafs.still_attached``): that image is unlinked instead (its loop device
    keeps it until then) and, with ``create``, a new one made."""
    mnt, image, loop_file = _mount_dir(layout), _image(layout), layout.disk_pool / "loop"
    with contextlib.suppress(FileNotFoundError):
        if quotafs.still_attached(loop_file.read_text().strip(), image):
            image.unlink()
    if not image.exists():
        if not create:
            return
        _make_image(layout, image, environ)
    mnt.mkdir(exist_ok=True)
    loop_file.write_text(quotafs.mount_image(image, mnt))


def _make_image(layout: NodeLayout, image: Path, environ: Mapping[str, str]) -> None:
    from runtime_shim.node.ledger import Ledger

    settings = BudgetSettings.from_env(environ)
    size = pool_size(environ, node_budget(read_host(layout.node), settings).limits.disk_bytes)
    tmp = image.with_name(f".{IMAGE_NAME}.new")
    book = Ledger(layout.node)
    granted = book.admit(POOL_KEY, Reservation(disk_bytes=size), image,
                         what="the sandbox disk pool", settings=settings,
                         min_disk=quotafs.MIN_POOL)
    try:
        quotafs.format_image(tmp, granted.disk_bytes >> 20 << 20)
        os.replace(tmp, image)
    except BaseException:
        tmp.unlink(missing_ok=True)
        book.release(POOL_KEY)
        raise


def pool_size(environ: Mapping[str, str], budget_disk: int) -> int:
    """The size of a new pool: ``ENVBUILD_DISK_POOL_SIZE``, else ``DEFAULT_POOL_SHARE`` of
    the node's disk budget (whole GiB), at least ``quotafs.MIN_POOL`` (pure)."""
    text = environ.get(POOL_SIZE_ENV, "").strip()
    if text:
        from envbuild.sizes import parse_size

        size = parse_size(text, what=POOL_SIZE_ENV)
        if size < quotafs.MIN_POOL:
            raise SettingsError(f"{POOL_SIZE_ENV}={text}: the pool needs at least 1 GiB",
                                hint="e.g. ENVBUILD_DISK_POOL_SIZE=100G")
        return size
    return max(quotafs.MIN_POOL, int(budget_disk * DEFAULT_POOL_SHARE) >> 30 << 30)


def _check_room(pool: Path, cap: int) -> None:
    st = os.statvfs(pool)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    need = min(cap, POOL_HEADROOM)
    if free < need:
        raise AdmissionRefused(
            f"sandbox disk pool {pool} has {free >> 20} MiB free of {size >> 20} MiB; a "
            f"sandbox needs {need >> 20} MiB free to start",
            hint=f"close sandboxes, or make a larger pool ({POOL_SIZE_ENV}, then remove the "
                 "pool's image while no sandbox runs)")


def _unmount_if_empty(mnt: Path) -> None:
    """Unmount the node's pool if it holds no subvolume, once its deleted subvolumes' blocks
    are given back to the host and their quota groups removed (``_release``). Busy (a file of
    the last sandbox still open while its processes exit): a few tries over
    ``UNMOUNT_PATIENCE`` seconds, then it is left to the next close; never lazily, or a
    remount of the image could meet the old one."""
    if not (os.path.ismount(mnt) and quotafs.is_empty(mnt)):
        return
    _release(mnt)
    deadline = time.monotonic() + UNMOUNT_PATIENCE
    while os.path.ismount(mnt) and quotafs.is_empty(mnt):
        try:
            unmount(str(mnt), lazy_fallback=False)
            return
        except RuntimeShimError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)


def _release(mnt: Path) -> None:
    """The pool just emptied: let the cleaner drop the deleted subvolumes (at most
    ``CLEANER_PATIENCE``), remove their quota groups, and trim the pool so its sparse image
    holds only the empty filesystem again (~1 MiB) when it holds more than ``TRIM_ABOVE``.
    Only here, never on the create path."""
    quotafs.settle(mnt, CLEANER_PATIENCE)
    quotafs.sweep_groups(mnt)
    if os.stat(mnt.parent / IMAGE_NAME).st_blocks * 512 > TRIM_ABOVE:
        quotafs.trim(mnt)


@contextlib.contextmanager
def _pool_lock(layout: NodeLayout) -> Iterator[None]:
    layout.disk_pool.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.disk_pool / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _mount_dir(layout: NodeLayout) -> Path:
    return layout.disk_pool / "mnt"


def _image(layout: NodeLayout) -> Path:
    return layout.disk_pool / IMAGE_NAME
