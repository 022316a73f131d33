"""Build one layer: import its source, run its steps in an isolated overlay, pack the upper dir.

The plan says *what* to build (``LayerJob``: plain data); this module does it (side effects):

1. lower dirs: the layers the job builds on (a Base's parent chain, a Workspace/Toolkit's
   ``build_on`` chain), unpacked once into the node cache, read-only, topmost first, plus the
   stub layer (``runtime_shim.isolation.stub``) at the bottom so runc never creates mount points in the
   upper dir;
2. a fresh upper dir: a Base's source is imported straight into it; a Workspace's source is
   copied through the overlay into ``dest``;
3. each step: ``run`` in a runc container over the overlay (mount, pid, ipc, uts namespaces;
   by default egress through the step's own network namespace behind user-mode NAT, the
   host's loopback and addresses unreachable (``runtime_shim.isolation.netns``), because package
   installs need it; ``network: none`` for an empty network namespace; the default seccomp
   profile and ``BuildLimits``, as a sandbox gets); ``copy`` through the overlay from the
   definition's directory;
4. the upper dir *is* the layer: packed with overlay whiteouts converted to OCI ones,
   put into the store (verified), and only then the key record is written. A failure at any
   point publishes nothing.

Everything lives under one scratch directory per build that is removed at the end, mounts
included, also on Ctrl-C. A layer's upper dir, work dir, its steps' ``/tmp``, a git import's
clone and a Dockerfile base's private dockerd data root (its images and what its ``RUN`` steps
write) are on a capped filesystem of their own (``runtime_shim.isolation.scratchfs``:
``BuildContext.disk_bytes`` / ``inodes``, 50 GiB and 5 M by default, ``ENVBUILD_BUILD_DISK`` /
``ENVBUILD_BUILD_INODES``), so a runaway step or import fails with ENOSPC instead of filling
the host.
A build that dies without cleaning up (SIGKILL, OOM, power loss)
leaves its dir owned by nobody: each scratch dir ``<root>/<id>`` has an owner file
``<root>/<id>.owner`` that the build holds ``flock``ed for its whole life (the kernel drops the
lock when the process dies), and ``sweep_stale_scratch`` — run at the start of every build and
by ``envbuild node gc`` — removes the dirs whose owner file it can lock (their containers
destroyed and mounts detached first, then ``safefs.remove_tree``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from envbuild.build import buildlog, copying, importers
from envbuild.build.layerjob import BuildEvent, LayerJob, Progress
from envbuild.build.pin import HOST_BUSYBOX, local_git_path
from envbuild.build.prefix import check_toolkit_prefix
from envbuild.build.reaper import sweep_stale_scratch  # noqa: F401  (re-exported)
from envbuild.build.scratch import claim_scratch, release_scratch
from envbuild.defs.model import (
    ArchiveSource,
    Base,
    BaseSource,
    BusyboxSource,
    CopyStep,
    DebootstrapSource,
    DockerfileSource,
    GitSource,
    ImageSource,
    LayerDefinition,
    OciSource,
    PathSource,
    RootfsSource,
    RunStep,
    ScratchSource,
    Toolkit,
    Workspace,
)
from envbuild.errors import BuildError, StepFailed
from envbuild.layers import pack_tree
from envbuild.safefs import read_tail
from envbuild.store import KeyRecord, Store, get_key_record, put_file, put_key_record
from runtime_shim.isolation import (
    CA_ENV_VARS,
    HOST_CA_PATH,
    BindMount,
    OciRuntime,
    OverlaySpec,
    RuntimeSpecRequest,
    clamped_rlimit,
    cpuclass,
    ensure_stub,
    env_list,
    host_ca_bundle,
    mount_overlay,
    netns,
    parse_user,
    run_container,
    runtime_spec,
    scratchfs,
    unmount,
    write_bundle,
)
from runtime_shim.node import BudgetSettings, Ledger, NodeCache, Reservation, build_key

OUTPUT_TAIL_LINES = 50
BUILD_LOG_CAP = buildlog.BUILD_LOG_CAP  # re-exported; read as buildlog.BUILD_LOG_CAP
BUILD_HOSTNAME = "envbuild"
#: Defaults of ``BuildContext.disk_bytes`` / ``inodes``: generous (a debootstrap + pip install
#: is a few GB), only there so a runaway step cannot fill the build host. The image is sparse.
DEFAULT_BUILD_DISK_BYTES = 50 << 30
DEFAULT_BUILD_INODES = 5_000_000
#: The smallest disk a layer gets when the node's disk budget has less left than its cap.
MIN_BUILD_DISK_BYTES = 1 << 30



@dataclasses.dataclass(frozen=True)
class BuildLimits:
    """Resource limits of every ``run`` step's container (its own cgroup), generous because
    compilers and package managers are hungry, but finite because a definition is untrusted
    input: 8 GiB of memory (no swap beyond it), 8192 tasks, 65536 open files (clamped to the
    host's hard limit), 4 cores of CPU time. ``None`` leaves a limit off. ``cpu_class``:
    best-effort by default (``SCHED_IDLE``, minimum CPU weight: ``runtime_shim.isolation.cpuclass``), so
    a build never takes CPU from latency-class sandboxes on the same node."""

    pids: int | None = 8192
    memory_bytes: int | None = 8 << 30
    nofile: int = 65536
    cpus: float | None = 4.0
    cpu_class: str = cpuclass.BUILD_CPU_CLASS


@dataclasses.dataclass
class BuildContext:
    """The side-effect handles a build needs, created once per ``envbuild build``."""

    store: Store
    node: NodeCache
    runtime: OciRuntime
    scratch_root: Path
    log_root: Path
    source_date_epoch: int = 0
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: Limits and syscall filter of run steps (``seccomp`` as for ``Sandbox.create``: None is
    #: the default profile, ``"unconfined"`` none, or an OCI ``linux.seccomp`` object).
    limits: BuildLimits = BuildLimits()
    seccomp: str | Mapping[str, Any] | None = None
    # The cap of one layer's writes (its upper dir and /tmp; runtime_shim.isolation.scratchfs). None: none.
    disk_bytes: int | None = DEFAULT_BUILD_DISK_BYTES
    inodes: int | None = DEFAULT_BUILD_INODES
    #: The node's budget (``runtime_shim.node.admission``): a layer's disk is reserved in the node's
    #: ledger before it is made, at ``disk_bytes`` or what the budget has left if that is less
    #: (at least ``MIN_BUILD_DISK_BYTES``); below that it waits up to ``admission_wait``
    #: seconds for other builds to give theirs back, and one that could never fit is refused.
    admission: BudgetSettings = dataclasses.field(default_factory=BudgetSettings)
    admission_wait: float = 1800.0
    #: Called with (layer name, bytes) as a ``run`` step writes its output (``envbuild build
    #: -v``), from the step's copier thread: all of it (the log keeps only its head and tail).
    on_output: Callable[[str, bytes], None] | None = None
    #: Lifetime of the build lease on a key in the store (``envbuild.store.lease``): how long
    #: a builder that died can keep others waiting. Renewed every third of it while building.
    lease_ttl: float = 30.0
    #: Free text put in this builder's leases, e.g. the Ray node id (for people looking).
    lease_label: str = ""
    #: Key records the caller already holds (key -> record), used before reading the store:
    #: a Ray task gets its lower layers' records with its arguments (one store read less each).
    known_records: Mapping[str, KeyRecord] = dataclasses.field(default_factory=dict)

    def stub_dir(self) -> Path:
        return ensure_stub(self.node.root)


@dataclasses.dataclass
class _LayerDirs:
    """Where one layer is built: its scratch dir (owned through ``owner``), the capped disk in
    it holding the overlay's upper and work dirs, the overlay's mount point and the log."""

    scratch: Path
    owner: int
    reserved: str                # the disk's reservation in the node's ledger
    disk_limit: int | None       # the disk's cap, lowered by admission when the node has less
    log: Path = Path()

    @property
    def disk(self) -> Path:
        return self.scratch / scratchfs.MOUNT_NAME

    @property
    def upper(self) -> Path:
        return self.disk / "upper"

    @property
    def merged(self) -> Path:
        return self.scratch / "merged"


def build_layer(ctx: BuildContext, job: LayerJob, progress: Progress) -> KeyRecord:
    """Build ``job`` and publish its blob and key record; return the record."""
    started = time.monotonic()
    _stop_if_cancelled(ctx, job)
    dirs = _claim_dirs(ctx, job, progress)
    mounted: list[str] = []
    try:
        imported = _fill_upper(ctx, job, dirs, progress, mounted)
        return _publish(ctx, job, dirs, imported, progress, started)
    finally:
        for target in mounted:
            unmount(target)
        for net_dir in dirs.scratch.glob("net-*"):  # a step's network (slirp, namespace file)
            netns.teardown(net_dir)
        scratchfs.destroy(dirs.scratch)
        release_scratch(dirs.scratch, dirs.owner)
        if ctx.disk_bytes is not None:
            Ledger(ctx.node.root).release(dirs.reserved)


def _claim_dirs(ctx: BuildContext, job: LayerJob, progress: Progress) -> _LayerDirs:
    """A new scratch dir for ``job`` with its capped disk (admitted by the node's budget) and
    an empty log; nothing is left behind if this fails."""
    scratch, owner = claim_scratch(ctx.scratch_root,
                                   f"{job.key.removeprefix('sha256:')[:16]}-{uuid.uuid4().hex[:8]}")
    ledger = Ledger(ctx.node.root)
    dirs = _LayerDirs(scratch, owner, build_key(scratch.name), ctx.disk_bytes)
    if ctx.disk_bytes is not None:
        try:
            granted = ledger.admit(dirs.reserved, Reservation(disk_bytes=ctx.disk_bytes), scratch,
                                   what=f"the build of {job.name}", settings=ctx.admission,
                                   wait=ctx.admission_wait,
                                   min_disk=min(ctx.disk_bytes, MIN_BUILD_DISK_BYTES),
                                   on_wait=lambda why: progress(BuildEvent(
                                       job.name, "waiting", detail=f"for disk: {why}")))
            # dev + suid: debootstrap makes /dev nodes in the upper dir and chroots into it
            dirs.disk_limit = granted.disk_bytes
            scratchfs.create(scratch, dirs.disk_limit, ctx.inodes,
                             template_root=ctx.node.root / "scratchfs", nodev_nosuid=False)
        except BaseException:
            release_scratch(scratch, owner)
            ledger.release(dirs.reserved)
            raise
    for p in (dirs.upper, dirs.disk / "work", dirs.merged, dirs.disk / "tmp"):
        p.mkdir(parents=True, exist_ok=True)
    os.chmod(dirs.disk / "tmp", 0o1777)
    ctx.log_root.mkdir(parents=True, exist_ok=True)
    buildlog.prune(ctx.log_root)
    dirs.log = ctx.log_root / f"{job.name}-{job.key.removeprefix('sha256:')[:12]}.log"
    dirs.log.write_bytes(b"")
    return dirs


def _fill_upper(ctx: BuildContext, job: LayerJob, dirs: _LayerDirs, progress: Progress,
                mounted: list[str]) -> importers.Imported:
    """Import the layer's source and run its steps over its lower layers: what they write is
    in ``dirs.upper``. Returns the imported image config; ``mounted`` holds what the caller
    unmounts if this fails."""
    d = job.definition
    lowers = []
    for k in job.lower_keys:
        below = ctx.known_records.get(k) or _record_of(ctx.store, k, job.name)
        lowers.append(str(ctx.node.ensure(ctx.store, below.layer, below.toc)))
    imported = importers.Imported()
    if isinstance(d, Base) and not isinstance(d.source, BaseSource):
        progress(BuildEvent(job.name, "importing", detail=d.source.kind))
        try:
            imported = _import_base(d, dirs.upper, dirs.log, ctx.cancelled, job=job,
                                    scratch=dirs.disk, daemon_root=ctx.node.root / "dockerd",
                                    store=ctx.store, runtime=ctx.runtime)
        except BuildError as e:
            raise _explain_full_import(ctx, e) from None
        finally:  # importers' subprocesses append to the log themselves
            buildlog.trim(dirs.log, buildlog.BUILD_LOG_CAP)
    if not d.steps and not isinstance(d, Workspace):
        return imported
    merged = dirs.merged
    spec = OverlaySpec(str(merged), (*lowers, str(ctx.stub_dir())), str(dirs.upper),
                       str(dirs.disk / "work"))
    mount_overlay(spec)
    mounted.append(str(merged))
    if isinstance(d, Workspace):
        progress(BuildEvent(job.name, "importing", detail=d.source.kind))
        # git clones into its scratch: on the capped disk too (a hostile repo can be huge)
        _import_workspace(d, job, merged, dirs.disk, ctx.cancelled)
    for i, step in enumerate(d.steps, 1):
        _stop_if_cancelled(ctx, job)
        progress(BuildEvent(job.name, "step", i, len(d.steps), _describe(step)))
        try:
            _run_step(ctx, job, i, step, merged, dirs.scratch, dirs.log)
        except StepFailed as e:
            raise _explain_full_disk(ctx, dirs.disk, dirs.disk_limit, e) from None
    unmount(str(merged))
    mounted.remove(str(merged))
    return imported


def _publish(ctx: BuildContext, job: LayerJob, dirs: _LayerDirs, imported: importers.Imported,
             progress: Progress, started: float) -> KeyRecord:
    """Pack the upper dir, put the blob into the store, then its key record."""
    d = job.definition
    if isinstance(d, Toolkit):
        check_toolkit_prefix(job.name, dirs.upper, d.prefix)
    _stop_if_cancelled(ctx, job)
    progress(BuildEvent(job.name, "packing"))
    blob = dirs.scratch / "layer.tar.zst"
    with open(blob, "wb") as out:
        info = pack_tree(dirs.upper, out, framing=d.framing, overlay_upper=True,
                         source_date_epoch=ctx.source_date_epoch)
    # Last chance to stop without publishing: once the blob is stored, the record follows.
    _stop_if_cancelled(ctx, job)
    stored = put_file(ctx.store, blob)
    if stored.digest != info.digest:
        raise BuildError(f"{job.name}: packed layer hashed to {stored.digest}, "
                         f"the writer reported {info.digest}")
    # the layer's pyc imports, for lazy sandboxes' import prediction (a hint: never fails
    # the build); before the key record, so a layer found built has its index
    from runtime_shim.lazyfs import index_layer_file

    index_layer_file(ctx.store, str(blob), info.digest)
    record = KeyRecord(
        layer=info.digest, toc=info.toc_digest, diff_id=info.diff_id, size=info.size,
        built_from={"name": job.name, "kind": d.kind, "lower_keys": list(job.lower_keys),
                    "seconds": round(time.monotonic() - started, 3)},
        extra={"config": {"env": dict(imported.env), "workdir": imported.workdir,
                          "user": imported.user,
                          "cmd": list(imported.cmd) if imported.cmd else None}}
        if imported != importers.Imported() else {},
    )
    put_key_record(ctx.store, job.key, record)  # after the blob: never a record without it
    return record


def _explain_full_disk(ctx: BuildContext, disk: Path, limit: int | None,
                       e: StepFailed) -> StepFailed:
    """``e``, or when the step left its disk (nearly) full, which most likely made it fail,
    the same error saying so in its one line."""
    if limit is None:
        return e
    st = os.statvfs(disk)
    out_of = ("space" if st.f_bavail * st.f_frsize < (1 << 20) else
              "inodes" if st.f_favail < 16 else None)
    if out_of is None:
        return e
    return StepFailed(f"{e.message} (out of {out_of}: the layer's disk limit is "
                      f"{limit >> 20} MiB / {ctx.inodes} inodes)",
                      argv=e.argv, exit_code=e.exit_code, output_tail=e.output_tail,
                      log_path=e.log_path,
                      hint="raise ENVBUILD_BUILD_DISK / ENVBUILD_BUILD_INODES, or write less")


#: How every tool (and Python) spells ENOSPC.
_ENOSPC = os.strerror(errno.ENOSPC).lower()


def _explain_full_import(ctx: BuildContext, e: BuildError) -> BuildError:
    """``e``, or when an import (a Dockerfile's ``RUN`` steps in the private dockerd, whose
    data root is on the layer's disk) ran out of space, the same error saying it met the
    layer's disk limit. Its disk is gone by now (the daemon removed its data): the cause is
    read from the error."""
    if ctx.disk_bytes is None or _ENOSPC not in f"{e.message}\n{e.context or ''}".lower():
        return e
    return BuildError(f"{e.message} (out of space: the layer's disk limit is "
                      f"{ctx.disk_bytes >> 20} MiB)", context=e.context,
                      hint="raise ENVBUILD_BUILD_DISK, or write less"
                           + (f"; {e.hint}" if e.hint else ""))


def _stop_if_cancelled(ctx: BuildContext, job: LayerJob) -> None:
    if ctx.cancelled.is_set():
        raise BuildError(f"{job.name}: cancelled", hint="nothing was published for this layer")


def _record_of(store: Store, key: str, for_name: str) -> KeyRecord:
    record = get_key_record(store, key)
    if record is None:
        raise BuildError(f"{for_name}: the layer it builds on (key {key[:19]}…) is not in the store",
                         hint="build its dependencies first (envbuild build builds them in order)")
    return record


def _describe(step) -> str:
    """A step in progress lines and the log: its kind and ``label`` (its ``name:``, or what its
    script does: ``envbuild.defs.model.run_label``)."""
    label = step.label if len(step.label) <= 60 else step.label[:59] + "…"
    return f"{'run' if isinstance(step, RunStep) else 'copy'}: {label}"


def _import_base(d: Base, upper: Path, log: Path, cancelled: threading.Event, *,
                 job: LayerJob | None = None, scratch: Path | None = None,
                 daemon_root: Path | None = None, store: Store | None = None,
                 runtime: OciRuntime | None = None) -> importers.Imported:
    src = d.source
    here = d.origin.directory
    if isinstance(src, ScratchSource):
        return importers.import_scratch(upper)
    if isinstance(src, BusyboxSource):
        # against the definition's directory, as pinning checked it (not the working directory)
        binary = here / src.binary
        if os.path.realpath(binary) in HOST_BUSYBOX or runtime is None or scratch is None:
            return importers.import_busybox(binary, upper)  # the host's own package binary
        # any other binary comes with the definitions: it runs in a container, never on the host
        return importers.import_busybox(binary, upper, list_applets=lambda root: _output_of(
            runtime, root, ("/bin/busybox", "--list-full"), scratch / "bundle-import", cancelled))
    if isinstance(src, RootfsSource):
        return importers.import_rootfs(here / src.path, src.sha256, upper)
    if isinstance(src, DebootstrapSource):
        return importers.import_debootstrap(src.suite, src.variant, src.include, src.mirror,
                                            upper, log, cancelled)
    if isinstance(src, OciSource):
        return importers.import_oci(here / src.layout, src.ref, upper)
    if isinstance(src, ImageSource):  # registry issue (16)
        return importers.import_image(src, upper)
    if isinstance(src, DockerfileSource):  # issue 17: BuildKit in a (private) dockerd
        from envbuild.build.dockerfile import build_dockerfile

        if job is None or scratch is None or daemon_root is None:
            raise BuildError(f"{d.name}: a Dockerfile base needs the build's scratch and node dirs")
        return build_dockerfile(src, d.name, here, job.pins, upper, scratch / "docker",
                                daemon_root, log, cancelled, store)
    raise BuildError(f"{d.name}: source kind {src.kind!r} cannot be imported")


#: What ``_output_of`` keeps of a command's output, and how long it may run.
_IMPORT_OUTPUT_CAP = 1 << 20
_IMPORT_TIMEOUT = 60.0


def _output_of(runtime: OciRuntime, rootfs: Path, args: tuple[str, ...], bundle: Path,
               cancelled: threading.Event) -> str:
    """The output of ``args`` run in a container on ``rootfs`` (read-only, no network, small
    limits, the default seccomp profile), for an importer that must run a file the definitions
    brought (a busybox binary listing its applets). Raises ``BuildError`` if it fails."""
    container_id = f"eb-build-{uuid.uuid4().hex[:12]}"  # the reaper's prefix: swept after a crash
    request = RuntimeSpecRequest(
        rootfs=str(rootfs), args=args, readonly_rootfs=True, tmpfs=(), hostname=BUILD_HOSTNAME,
        pids_limit=64, memory_limit=256 << 20, cpus=1.0, cgroups_path=f"/envbuild/{container_id}")
    write_bundle(bundle, runtime_spec(request))
    out = bundle / "output"
    with open(out, "wb") as f:
        result = run_container(runtime, container_id, bundle, stdout=f,
                               stderr=subprocess.DEVNULL, timeout=_IMPORT_TIMEOUT,
                               cancelled=cancelled, cpu_class=cpuclass.BUILD_CPU_CLASS)
    text = read_tail(out, _IMPORT_OUTPUT_CAP) if out.stat().st_size <= _IMPORT_OUTPUT_CAP else ""
    if result.cancelled:
        raise BuildError(f"{' '.join(args)}: cancelled")
    if result.exit_code != 0 or not text:
        raise BuildError(f"{' '.join(args)} exited {result.exit_code} in its container"
                         + ("" if text else " (no output, or more than 1 MiB)"),
                         hint="the binary must be a static busybox for this architecture")
    return text


def _import_workspace(d: Workspace, job: LayerJob, merged: Path, scratch: Path,
                      cancelled: threading.Event) -> None:
    # dest is resolved inside the rootfs: an image's symlink never sends the source to the host
    dest = copying.open_dir_in_root(merged, d.dest)
    try:
        src = d.source
        here = d.origin.directory
        if isinstance(src, PathSource):
            importers.import_path(here / src.path, dest)
        elif isinstance(src, GitSource):
            commit = job.pins.get("source")
            if not commit:
                raise BuildError(f"{d.name}: git source was not pinned to a commit")
            importers.import_git(local_git_path(src.url, str(here)) or src.url, commit, dest,
                                 scratch, cancelled, strip_components=src.strip_components,
                                 dotgit=src.dotgit)
        elif isinstance(src, ArchiveSource):
            importers.import_archive(here / src.path, src.sha256, dest,
                                     strip_components=src.strip_components)
    finally:
        os.close(dest)


def _run_step(ctx: BuildContext, job: LayerJob, index: int, step, merged: Path, scratch: Path,
              log: Path) -> None:
    d = job.definition
    with open(log, "ab") as out:
        out.write(f"=== {job.name}: step {index}/{len(d.steps)}: {_describe(step)}\n".encode())
    if isinstance(step, CopyStep):
        _copy_step(d, step, merged)
        return
    assert isinstance(step, RunStep)
    # SOURCE_DATE_EPOCH: layers clamp mtimes to it, so tools that embed timestamps (Python's
    # .pyc, dpkg) should use it too, or their caches go stale in every sandbox.
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "SOURCE_DATE_EPOCH": str(ctx.source_date_epoch),
           **job.build_env, **step.env}
    net, binds, env = _step_network(step, scratch / f"net-{index}", env)
    # /tmp on the layer's capped disk, outside the upper dir (not in the layer), as a tmpfs was.
    binds += (BindMount(str(merged.parent / scratchfs.MOUNT_NAME / "tmp"), "/tmp",
                        readonly=False),)
    container_id = f"eb-build-{uuid.uuid4().hex[:12]}"
    uid, gid = parse_user(step.user)
    limits = ctx.limits
    request = RuntimeSpecRequest(
        rootfs=str(merged), args=("/bin/sh", "-c", step.run), env=env_list(env),
        cwd=step.workdir or "/", uid=uid, gid=gid, hostname=BUILD_HOSTNAME,
        network=net is not None, network_ns=net.path if net else None, binds=binds, tmpfs=(),
        rlimits=(clamped_rlimit("RLIMIT_NOFILE", limits.nofile),),
        pids_limit=limits.pids, memory_limit=limits.memory_bytes, cpus=limits.cpus,
        cpu_shares=cpuclass.cpu_shares(limits.cpu_class),
        cgroups_path=f"/envbuild/{container_id}", seccomp=ctx.seccomp)
    bundle = scratch / f"bundle-{index}"
    write_bundle(bundle, runtime_spec(request))
    result = _run_logged(ctx, job, container_id, bundle, log)
    if net is not None:
        net.close()
    if result.cancelled:
        _stop_if_cancelled(ctx, job)
    if result.exit_code != 0:
        raise StepFailed(
            f"{job.name}: step {index}/{len(d.steps)} exited {result.exit_code}: {step.label}",
            argv=list(request.args), exit_code=result.exit_code,
            output_tail=_tail(log, OUTPUT_TAIL_LINES), log_path=str(log))


def _step_network(step: RunStep, net_dir: Path, env: dict[str, str]):
    """(the step's network or None, its binds, its env) for ``network: host``: egress, not the
    host (the step's own namespace behind slirp4netns with the host's loopback and addresses
    refused, as for sandboxes: ``runtime_shim.isolation.netns``; definitions are untrusted input too).
    On an exception the scratch cleanup tears it down."""
    binds: tuple[BindMount, ...] = ()
    if step.network != "host":
        return None, binds, env
    net_dir.mkdir()
    net = netns.create(net_dir, netns.NetworkPolicy())
    binds = (BindMount(net.resolv_conf, "/etc/resolv.conf"),
             BindMount("/etc/hosts", "/etc/hosts"))
    ca = host_ca_bundle()
    if ca is not None:
        # The host may reach registries through a proxy only its own CA bundle trusts;
        # point the usual clients at it without touching the image's /etc/ssl.
        binds += (BindMount(ca, HOST_CA_PATH),)
        env = {**{k: HOST_CA_PATH for k in CA_ENV_VARS}, **env}
    return net, binds, env


def _run_logged(ctx: BuildContext, job: LayerJob, container_id: str, bundle: Path, log: Path):
    """Run the step's container with its output appended to ``log`` (and handed to
    ``ctx.on_output``); returns ``run_container``'s result."""
    with buildlog.CappedLog(log, buildlog.BUILD_LOG_CAP) as out:
        # The step runs on a pool thread, which Ctrl-C/SIGTERM never interrupts: the engine
        # sets ctx.cancelled and run_container kills and deletes the container when it sees it.
        # Its output reaches the log through a pipe and a copier; the log keeps its head and
        # tail (BUILD_LOG_CAP), the copier reads everything so the step never blocks on it.
        read_fd, write_fd = os.pipe()
        sink = out if ctx.on_output is None else buildlog.Tee(out, job.name, ctx.on_output)
        copier = threading.Thread(target=scratchfs.copy_capped,
                                  args=(read_fd, sink, sys.maxsize), daemon=True)
        copier.start()
        try:
            return run_container(ctx.runtime, container_id, bundle, stdout=write_fd,
                                 cancelled=ctx.cancelled, cpu_class=ctx.limits.cpu_class)
        finally:
            os.close(write_fd)  # the copier sees EOF once the container's processes are gone
            copier.join()


def _copy_step(d: LayerDefinition, step: CopyStep, merged: Path) -> None:
    """Copy ``step.src`` (confined to the source root when the tree was pinned) into the
    rootfs: the destination resolved inside ``merged``, symlinks of a copied tree kept as links,
    nothing written through a symlink (``copying.copy_source_tree``)."""
    # the same resolution the pin checked (envbuild.build.pin.confined_path)
    src = Path(os.path.realpath(d.origin.directory / step.src))
    uid, gid = parse_user(step.owner)
    if not src.exists():
        raise BuildError(f"{d.name}: copy source {src} does not exist",
                         hint="copy.src is relative to the definition file")
    rel = step.dest.strip("/")
    if src.is_dir():
        dest = copying.open_dir_in_root(merged, rel)
        try:
            copying.copy_source_tree(src, dest, owner=(uid, gid), mode=step.mode)
        finally:
            os.close(dest)
        return
    parent, _, base = rel.rpartition("/")
    if step.dest.endswith("/") or not base:
        parent, base = rel, src.name
    pfd = copying.open_dir_in_root(merged, parent)
    try:
        copying.copy_file_into(str(src), pfd, base, owner=(uid, gid), mode=step.mode)
    finally:
        os.close(pfd)


def _tail(log: Path, lines: int) -> str:
    return "\n".join(read_tail(log, 256 * 1024).splitlines()[-lines:])
