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
    mnt/       its mount (one loop device for the node), while it holds a subvolume and for a
               grace period after the last one went (``ENVBUILD_DISK_POOL_GRACE``, 60 s): the
               next sandbox of a busy node then pays no mount, and its close no release.
               Past the grace, ``unmount_idle`` (a timer of the process whose close emptied
               the pool, that process's exit, ``envbuild sandbox gc``) waits for the kernel's
               cleaner, removes the quota groups the deleted subvolumes left, trims the image
               (``_release``) and unmounts it (the image stays, ~1 MiB allocated; mounting it
               again costs ~2 ms, unless the last instance is not released yet: then a new
               image), so an idle node holds no mount, no loop device and no stale quota group
    idle       touched by the close that empties the pool: its mtime is when the grace began
    loop       the loop device of the last mount (``quotafs.still_attached``)
    mnt/<id>   a sandbox's subvolume, capped by its quota group; ``SandboxPaths.disk`` is a
               symlink to it, written before the subvolume exists, so every cleanup that finds
               the sandbox's dir finds its subvolume too
    lock       ``flock``ed while the pool is mounted, a subvolume made or deleted, or the pool
               unmounted

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

import atexit
import contextlib
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from envbuild.errors import AdmissionRefused, RuntimeShimError, SettingsError
from runtime_shim.isolation import lifecycle, quotafs, scratchfs
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
GRACE_ENV = "ENVBUILD_DISK_POOL_GRACE"
MODES = ("pool", "loop")
POOL_KEY = "pool:sandboxes"
IMAGE_NAME = "pool.img"
#: A sandbox is admitted while the pool has this much free (or its whole cap, if smaller).
POOL_HEADROOM = 1 << 30
#: How long an empty pool stays mounted (seconds) in a process that serves a node — `envbuild
#: serve`, a fleet node daemon (``hold_pools``): mounting it costs its next sandbox ~2-7 ms
#: and releasing it the emptying close 7+ ms (issue 39: +7.1 ms a lifecycle on an otherwise
#: idle node, +0.4 ms with the pool held), paid by every lifecycle of a node that runs one
#: sandbox at a time. A minute covers an RL worker's gap between episodes.
SERVICE_GRACE = 60.0
#: Elsewhere (a script, the CLI, a library user) no grace unless ``ENVBUILD_DISK_POOL_GRACE``
#: asks: a pool left mounted after the last close would make removing a node dir fail (EBUSY)
#: until the process exits — a surprise for a library user; a long-lived worker sets the
#: variable (docs/disk-pool.md).
DEFAULT_GRACE = 0.0
_default_grace = DEFAULT_GRACE


def hold_pools(seconds: float = SERVICE_GRACE) -> None:
    """This process serves a node (``envbuild serve``, a fleet node daemon): its empty pools
    stay mounted ``seconds`` unless ``ENVBUILD_DISK_POOL_GRACE`` says otherwise."""
    global _default_grace
    _default_grace = seconds
#: How long the pool's release retries its unmount while it is busy.
UNMOUNT_PATIENCE = 0.5
#: How long the pool's release waits for the kernel's cleaner to drop the deleted subvolumes
#: before it trims the pool (what it has not freed by then is trimmed next time).
CLEANER_PATIENCE = 2.0
#: The pool's release trims it when its image holds more than this (a trim costs 40-85 ms
#: with 200 MiB to give back, 0.4-16 ms with nothing: not worth it below).
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
    if own:
        grace(environ)  # a bad setting fails the create, never a close
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


def destroy_disk(paths: SandboxPaths, environ: Mapping[str, str] = os.environ) -> None:
    """Delete the sandbox's disk, whichever kind it has; idempotent. When this deleted the
    last subvolume of the node's own pool, the pool's grace begins (``ENVBUILD_DISK_POOL_GRACE``;
    ``unmount_idle`` ends it); with a grace of 0, or while this process exits, the pool is
    released and unmounted here."""
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
        if own and os.path.ismount(target.parent) and quotafs.is_empty(target.parent):
            _begin_grace(layout, environ)


def grace(environ: Mapping[str, str]) -> float:
    """``ENVBUILD_DISK_POOL_GRACE``: seconds an empty pool stays mounted (default 0, or
    ``SERVICE_GRACE`` in a process that ``hold_pools``; 0: unmounted with its last sandbox);
    ``SettingsError`` otherwise."""
    text = environ.get(GRACE_ENV, "").strip()
    if not text:
        return _default_grace
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise SettingsError(f"{GRACE_ENV}={text}: not a number of seconds >= 0",
                            hint=f"e.g. {GRACE_ENV}=60; 0 unmounts the pool with its last "
                                 "sandbox")
    return value


def unmount_idle(layout: NodeLayout, grace: float = 0.0) -> float | None:
    """Release and unmount the node's own pool if it holds no subvolume and has been empty
    for ``grace`` seconds (a pool mounted without a stamp, after a crash, has been; 0: now):
    what ``envbuild sandbox gc``, this process's exit and its grace timers do. Returns the
    seconds left of the grace when it has not passed yet, else None; under the pool's lock,
    so a create meanwhile waits and keeps the pool."""
    mnt = _mount_dir(layout)
    if not os.path.ismount(mnt):  # the common case of a node without a pool: no lock file
        return None
    with _pool_lock(layout):
        if not (os.path.ismount(mnt) and quotafs.is_empty(mnt)):
            return None
        try:
            idle = time.time() - os.stat(layout.disk_pool / IDLE_NAME).st_mtime
        except FileNotFoundError:
            idle = math.inf
        if idle < grace:
            return grace - idle
        _unmount_if_empty(mnt)
    return None


def unmount_all_idle() -> None:
    """Unmount now every pool whose grace this process began (``unmount_idle`` with 0), and
    stop their timers: at this process's exit (an ``atexit`` hook), and in a test's teardown,
    so nothing it mounted outlives it. One that fails is logged and left to ``sandbox gc``."""
    with _graces_guard:
        pending = list(_graces.items())
        _graces.clear()
    for node, timer in pending:
        timer.cancel()
        try:
            unmount_idle(NodeLayout(node))
        except (OSError, RuntimeShimError) as e:
            _log.warning("unmount the sandbox disk pool of %s: %s", node, e)


#: The file whose mtime says since when the pool is empty (``unmount_idle``).
IDLE_NAME = "idle"
_log = logging.getLogger("envbuild.sandbox")
#: The pools (by node dir) whose grace this process began, each with its timer.
_graces: dict[Path, threading.Timer] = {}
_graces_guard = threading.Lock()


def _begin_grace(layout: NodeLayout, environ: Mapping[str, str]) -> None:
    """The pool just emptied (under its lock): stamp the time, and have a timer of this
    process unmount it once the grace has passed with no sandbox back. Now instead with a
    grace of 0 (or a bad value), or while this process exits (no thread may start then)."""
    try:
        wait = grace(environ)
    except SettingsError:
        wait = 0.0
    if wait == 0 or lifecycle.exiting():
        _unmount_if_empty(_mount_dir(layout))
        return
    (layout.disk_pool / IDLE_NAME).touch()
    _arm(layout.root, wait)


def _arm(node: Path, wait: float) -> None:
    with _graces_guard:
        if node in _graces:  # the armed timer finds the later stamp and waits on
            return
        timer = threading.Timer(wait, _grace_over, (node, wait))
        timer.daemon = True
        _graces[node] = timer
    timer.start()


def _grace_over(node: Path, wait: float) -> None:
    with _graces_guard:
        if _graces.get(node) is not threading.current_thread():
            return  # unmount_all_idle took over
        del _graces[node]
    try:
        left = unmount_idle(NodeLayout(node), wait)
    except (OSError, RuntimeShimError) as e:
        _log.warning("unmount the sandbox disk pool of %s: %s", node, e)
        return
    if left is not None:  # emptied again meanwhile: its grace runs from then
        _arm(node, left)


def _forget_in_child() -> None:
    """A forked child inherits no timer (the pools it empties it arms itself), and the guard
    afresh: another thread may have held it at the fork."""
    global _graces_guard
    _graces_guard = threading.Lock()
    _graces.clear()


atexit.register(unmount_all_idle)
os.register_at_fork(after_in_child=_forget_in_child)


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
    ``UNMOUNT_PATIENCE`` seconds, then it is left to the next ``unmount_idle``; never lazily,
    or a remount of the image could meet the old one."""
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
    """The pool is empty and about to be unmounted: let the cleaner drop the deleted
    subvolumes (at most ``CLEANER_PATIENCE``), remove their quota groups, and trim the pool so
    its sparse image holds only the empty filesystem again (~1 MiB) when it holds more than
    ``TRIM_ABOVE``. Only here, never on the create path."""
    quotafs.settle(mnt, CLEANER_PATIENCE)
    quotafs.sweep_groups(mnt)
    try:
        held = os.stat(mnt.parent / IMAGE_NAME).st_blocks * 512
    except FileNotFoundError:  # removed under its mount (an rmtree of the node dir in its
        return  # grace): unmounting is all that is left to do
    if held > TRIM_ABOVE:
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
