"""Source importers: put a layer's starting files into a directory (side effects).

One small function per source kind. Each writes into ``dest`` (an empty directory, or for a
workspace the ``dest`` path inside the build rootfs) and returns an ``Imported`` with whatever
runtime config the source carries (only ``oci`` images have one). Integrity is checked here:
a declared ``sha256`` is enforced before a single byte is extracted.

Trust: definitions, images and tarballs are hostile input (DESIGN.md, threat model). Every tar
(rootfs tarballs, OCI layers, archives, git archives) goes through the one safe unpacker,
``envbuild.layers._unpack.unpack_tar``: nothing is written or removed through a symlink, no
``..``, no device nodes (runc provides ``/dev``; a tarball or image holding them is refused),
whiteouts only in OCI layers and only applied to lower layers. A workspace's ``dest`` and a
copy step's ``dest`` are resolved inside the build rootfs (``envbuild.build.copying``), so a
symlink in the image can never send a copy to the host; copied trees keep their symlinks as
links.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from envbuild.build import gitdir
from envbuild.build.copying import copy_source_tree, drop_devices
from envbuild.build.gitoid import is_git_oid
from envbuild.build.pin import check_git_source, git_env, static_elf_problem
from envbuild.canonical import read_json_file
from envbuild.errors import BuildError, SourceError
from envbuild.oci import digest_hex


@dataclasses.dataclass(frozen=True)
class Imported:
    """Config a source brings along (an OCI image's Env, WorkingDir, User, Cmd)."""

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cmd: tuple[str, ...] | None = None


def run_tool(argv: list[str], what: str, *, cwd: str | None = None,
             cancelled: threading.Event | None = None, stdout=subprocess.PIPE,
             stderr=subprocess.PIPE, env: Mapping[str, str] | None = None,
             stdin=subprocess.DEVNULL) -> str:
    """Run a tool to completion; a set ``cancelled`` event (Ctrl-C / SIGTERM of the build)
    kills its whole process group within ~0.1 s instead of waiting for, say, debootstrap."""
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdin=stdin, stdout=stdout,
                                stderr=stderr, start_new_session=True,
                                env=dict(env) if env is not None else None)
    except FileNotFoundError:
        raise BuildError(f"{what}: {argv[0]} is not installed",
                         hint="run scripts/setup.sh to install the tools envbuild drives") from None
    except OSError as e:  # e.g. not executable
        raise BuildError(f"{what}: run {argv[0]}: {e.strerror}") from None
    out_chunks: list[bytes] = []
    err_chunks: list[bytes] = []
    readers = [threading.Thread(target=lambda p=p, acc=acc: acc.append(p.read()), daemon=True)
               for p, acc in ((proc.stdout, out_chunks), (proc.stderr, err_chunks)) if p]
    for t in readers:
        t.start()
    try:
        while True:
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if cancelled is not None and cancelled.is_set():
                    raise BuildError(f"{what}: cancelled") from None
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    finally:
        for t in readers:
            t.join()
    if proc.returncode != 0:
        err = b"".join(err_chunks).decode(errors="replace")
        tail = "\n".join(err.splitlines()[-20:])
        raise BuildError(f"{what}: {' '.join(argv[:3])} exited {proc.returncode}", context=tail)
    return b"".join(out_chunks).decode(errors="replace")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def check_sha256(path: Path, expected: str | None, what: str) -> None:
    if expected is None:
        return
    want = expected if expected.startswith("sha256:") else "sha256:" + expected
    got = sha256_file(path)
    if got != want:
        raise SourceError(f"{what}: {path} has {got}, the definition says {want}",
                          hint="update sha256 in the definition if the new file is intended")


# ----------------------------------------------------------------------------- bases


def import_scratch(dest: Path) -> Imported:
    dest.mkdir(parents=True, exist_ok=True)
    return Imported()


def import_busybox(binary: Path, dest: Path,
                   list_applets: Callable[[Path], str] | None = None) -> Imported:
    """A minimal rootfs: the static busybox binary, a link per applet, and the FHS skeleton.

    Applet locations come from ``busybox --list-full`` (``usr/bin/awk``, ``sbin/ip`` …), so the
    result looks like a busybox-based distribution. The binary must be a static ELF executable
    (it runs in containers with no libc). ``list_applets(dest)`` runs ``/bin/busybox
    --list-full`` once the binary is in ``dest`` (the executor's: in a container); without
    it, the binary is run on the host: only for the host's own package binary.
    """
    if not binary.is_file():
        raise SourceError(f"busybox binary {binary} not found",
                          hint="apt-get install busybox-static, or set from.busybox.binary")
    problem = static_elf_problem(str(binary))  # checked when pinned too; never run a script
    if problem is not None:
        raise SourceError(problem, hint="name a static busybox (apt-get install busybox-static)")
    if list_applets is None:
        listing = run_tool([str(binary), "--list-full"], "list busybox applets")
    for d, mode in (("bin", 0o755), ("sbin", 0o755), ("usr/bin", 0o755), ("usr/sbin", 0o755),
                    ("etc", 0o755), ("root", 0o700), ("tmp", 0o1777), ("proc", 0o555),
                    ("sys", 0o555), ("dev", 0o755), ("var/tmp", 0o1777), ("home", 0o755)):
        (dest / d).mkdir(parents=True, exist_ok=True)
        os.chmod(dest / d, mode)
    shutil.copyfile(binary, dest / "bin" / "busybox")
    os.chmod(dest / "bin" / "busybox", 0o755)
    if list_applets is not None:
        listing = list_applets(dest)
    for applet in sorted(set(listing.split())):
        if applet in ("bin/busybox", "linuxrc") or "/" not in applet:
            continue
        # what the binary printed: never a path out of dest (nor through a link made here)
        if applet.startswith("/") or any(p in ("", ".", "..") for p in applet.split("/")) \
                or applet.count("/") > 3:
            raise SourceError(f"busybox --list-full printed {applet[:80]!r}, not an applet path",
                              hint="the binary must be a genuine static busybox")
        target = dest / applet
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            rel = os.path.relpath(dest / "bin" / "busybox", target.parent)
            if not target.exists() and not target.is_symlink():
                os.symlink(rel, target)
        except OSError as e:  # e.g. a/b after a (a link to the binary): printed by a fake
            raise SourceError(f"busybox applet {applet[:80]!r}: {e.strerror}",
                              hint="the binary must be a genuine static busybox") from None
    return Imported()


def extract_tar(archive: Path, dest: Path | int, what: str, *, whiteouts: str = "refuse",
                strip_components: int = 0) -> None:
    """Unpack ``archive`` (any compression) below ``dest`` (a path or a directory fd) with the
    one safe unpacker; ``what`` names it in errors. ``strip_components`` as ``tar
    --strip-components`` (see ``unpack_tar`` for what it refuses)."""
    from envbuild.layers import unpack_tar

    if not isinstance(dest, int):
        dest.mkdir(parents=True, exist_ok=True)
    unpack_tar(archive, dest, name=what, whiteouts=whiteouts, strip_components=strip_components)


def copy_tree(src: Path, dest: Path) -> None:
    """Copy a directory tree keeping modes, owners, symlinks, hardlinks and xattrs (a rootfs
    directory: device nodes are refused afterwards, as in tarballs)."""
    dest.mkdir(parents=True, exist_ok=True)
    run_tool(["cp", "-a", "--", f"{src}/.", str(dest)], f"copy {src}")
    drop_devices(dest, refuse=f"rootfs {src}")


def import_rootfs(path: Path, sha256: str | None, dest: Path) -> Imported:
    if path.is_dir():
        if sha256:
            raise SourceError(f"rootfs {path} is a directory; sha256 applies to tarballs only",
                              hint="remove sha256 (the directory is hashed as a tree)")
        copy_tree(path, dest)
    elif path.is_file():
        check_sha256(path, sha256, "rootfs")
        extract_tar(path, dest, f"rootfs {path.name}")
    else:
        raise SourceError(f"rootfs {path} does not exist", hint="fix from.rootfs in the definition")
    return Imported()


def default_debian_mirror(sources_dirs: Iterable[str] = ("/etc/apt/sources.list",
                                                          "/etc/apt/sources.list.d")) -> str:
    """The Debian mirror this machine's apt uses, else deb.debian.org."""
    pattern = re.compile(r"^(?:deb\s+(?:\[[^\]]*\]\s+)?|URIs:\s*)(\S+)", re.M)
    files: list[str] = []
    for p in sources_dirs:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p))
        elif os.path.isfile(p):
            files.append(p)
    for f in files:
        try:
            text = Path(f).read_text(errors="replace")
        except OSError:
            continue
        for url in pattern.findall(text):
            if url.rstrip("/").endswith("/debian"):
                return url
    return "http://deb.debian.org/debian"


def import_debootstrap(suite: str, variant: str, include: tuple[str, ...], mirror: str | None,
                       dest: Path, log: Path, cancelled: threading.Event | None = None
                       ) -> Imported:
    argv = ["debootstrap", f"--variant={variant}"]
    if include:
        argv.append("--include=" + ",".join(include))
    argv += [suite, str(dest), mirror or default_debian_mirror()]
    with open(log, "ab") as out:
        try:
            run_tool(argv, f"debootstrap {suite}", cancelled=cancelled, stdout=out,
                 stderr=subprocess.STDOUT)
        except BuildError as e:
            if e.message.endswith("cancelled") or "not installed" in e.message:
                raise
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-50:])
            raise BuildError(e.message, context=tail, hint=f"full log: {log}") from None
    # debootstrap copies the host's resolv.conf and hostname into the new root: host facts
    # that must not end up in a layer (runc binds its own at run time).
    for leaked in ("etc/resolv.conf", "etc/hostname"):
        p = dest / leaked
        if p.is_file() and not p.is_symlink():
            p.write_bytes(b"")
    # debootstrap mknods /dev/null, /dev/zero, ... into the rootfs: runc mounts its own /dev,
    # and device nodes never enter a layer (the node cache refuses them).
    drop_devices(dest)
    # Debootstrap leaves caches and logs that differ run to run and serve no sandbox.
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = dest / junk
        if d.is_dir():
            for entry in os.scandir(d):
                if entry.is_file(follow_symlinks=False) and entry.name not in ("lock",):
                    os.unlink(entry.path)
    return Imported()


# ----------------------------------------------------------------------------- OCI images

# compression is told apart by magic bytes (``unpack_tar``); the media type must be a layer
_LAYER_MEDIA_TYPES = frozenset({
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
})


def _blob_path(layout: Path, digest: str) -> Path:
    hexpart = digest_hex(digest)
    if hexpart is None:
        raise SourceError(f"OCI layout {layout}: unsupported digest {digest!r}")
    return layout / "blobs" / "sha256" / hexpart


def _read_json_blob(layout: Path, digest: str) -> dict:
    path = _blob_path(layout, digest)
    if not path.is_file():
        raise SourceError(f"OCI layout {layout}: blob {digest} is missing")
    check_sha256(path, digest, f"OCI layout {layout}")
    return _layout_json(layout, path)


def _layout_json(layout: Path, path: Path) -> dict:
    """A JSON object of an OCI layout (untrusted input): bounded in size and nesting."""
    try:
        doc = read_json_file(path)
    except ValueError as e:
        raise SourceError(f"OCI layout {layout}: {path.name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SourceError(f"OCI layout {layout}: {path.name} is not a JSON object")
    return doc


def resolve_oci_manifest(layout: Path, ref: str) -> str:
    """The manifest digest that ``ref`` names in ``layout``'s index.json (nested indexes followed
    to the linux/amd64 entry)."""
    index_path = layout / "index.json"
    if not index_path.is_file():
        raise SourceError(f"{layout} is not an OCI image layout (no index.json)",
                          hint="produce one with `skopeo copy docker-archive:… oci:DIR:REF`")
    index = _layout_json(layout, index_path)
    names = []
    for desc in index.get("manifests", []):
        name = desc.get("annotations", {}).get("org.opencontainers.image.ref.name")
        names.append(name)
        if name == ref:
            return _pick_platform(layout, desc)
    raise SourceError(f"OCI layout {layout} has no ref {ref!r}",
                      hint=f"refs there: {', '.join(n for n in names if n) or 'none'}")


def _pick_platform(layout: Path, desc: dict) -> str:
    if desc.get("mediaType") != "application/vnd.oci.image.index.v1+json":
        return desc["digest"]
    nested = _read_json_blob(layout, desc["digest"])
    for m in nested.get("manifests", []):
        p = m.get("platform", {})
        if p.get("os") == "linux" and p.get("architecture") == "amd64":
            return _pick_platform(layout, m)
    raise SourceError(f"OCI layout {layout}: no linux/amd64 image in index {desc['digest']}")


def import_oci(layout: Path, ref: str, dest: Path) -> Imported:
    manifest = _read_json_blob(layout, resolve_oci_manifest(layout, ref))
    config = _read_json_blob(layout, manifest["config"]["digest"]).get("config") or {}
    dest.mkdir(parents=True, exist_ok=True)
    for layer in manifest.get("layers", []):
        if layer.get("mediaType") not in _LAYER_MEDIA_TYPES:
            raise SourceError(f"OCI layout {layout}: layer media type {layer.get('mediaType')!r} "
                              "is not supported")
        path = _blob_path(layout, layer["digest"])
        check_sha256(path, layer["digest"], f"OCI layout {layout}")
        extract_tar(path, dest, f"OCI layer {layer['digest'][:19]}", whiteouts="apply")
    env = {}
    for item in config.get("Env") or []:
        k, _, v = item.partition("=")
        env[k] = v
    cmd = config.get("Cmd")
    return Imported(env=env, workdir=config.get("WorkingDir") or None,
                    user=config.get("User") or None, cmd=tuple(cmd) if cmd else None)


def import_image(src, dest: Path) -> Imported:
    """``from: {image: HOST/REPO@sha256:…}`` (issue 16): the image's manifest (an index picks
    ``src.platform``) and layers from the registry, every blob verified by the registry store
    (streams read to their end), applied in order with their whiteouts by the safe unpacker;
    the config's Env/WorkingDir/User/Cmd are kept."""
    from envbuild.errors import BlobNotFound, DigestMismatch

    host, repo, digest, _tag = src.split()
    if digest is None:
        raise SourceError(f"image {src.ref} names no digest", hint="pin it: REPO@sha256:…")
    try:
        return _import_image(src, host, repo, digest, dest)
    except BlobNotFound as e:  # the store's hints speak of envbuild stores: say what it means here
        raise SourceError(f"image {src.ref}: {e.message.replace(' in the store', '')} in "
                          f"{host}/{repo}",
                          hint=f"check the digest (skopeo inspect docker://{host}/{repo}:TAG "
                               "prints it)") from None
    except DigestMismatch as e:
        raise SourceError(f"image {src.ref}: {e.message}",
                          hint="the registry or a proxy altered it; nothing was imported") from None


def _import_image(src, host: str, repo: str, digest: str, dest: Path) -> Imported:
    import json

    from envbuild.settings import Settings
    from envbuild.store.registry import RegistryStore

    store = RegistryStore(f"docker://{host}/{repo}",
                          insecure=Settings.from_env(os.environ).registry_insecure)

    def blob_json(d: str) -> dict:
        with store.get(d) as f:
            data = f.read(4 << 20)
            if f.read(1):
                raise SourceError(f"image {src.ref}: {d} is too large for a manifest or config")
        try:
            doc = json.loads(data)
        except ValueError:
            raise SourceError(f"image {src.ref}: {d} is not JSON") from None
        if not isinstance(doc, dict):
            raise SourceError(f"image {src.ref}: {d} is not a JSON object")
        return doc

    manifest = blob_json(digest)
    if manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
        os_name, _, arch = src.platform.partition("/")
        picked = [m for m in manifest.get("manifests") or []
                  if (m.get("platform") or {}).get("os") == os_name
                  and (m.get("platform") or {}).get("architecture") == arch]
        if not picked:
            have = sorted({"{os}/{architecture}".format(**{"os": "?", "architecture": "?",
                                                           **(m.get("platform") or {})})
                           for m in manifest.get("manifests") or []})
            raise SourceError(f"image {src.ref}: no {src.platform} image in its index",
                              hint=f"platforms there: {', '.join(have) or 'none'}")
        manifest = blob_json(picked[0]["digest"])
    config = blob_json(manifest["config"]["digest"]).get("config") or {}
    dest.mkdir(parents=True, exist_ok=True)
    for layer in manifest.get("layers") or []:
        if layer.get("mediaType") not in _LAYER_MEDIA_TYPES | _DOCKER_LAYER_TYPES:
            raise SourceError(f"image {src.ref}: layer media type {layer.get('mediaType')!r} "
                              "is not supported")
        from envbuild.layers import unpack_tar

        with store.get(layer["digest"]) as f:
            unpack_tar(f, dest, name=f"image layer {layer['digest'][:19]}", whiteouts="apply")
            while f.read(1 << 20):  # to the end: the store checks the digest there
                pass
    env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
    cmd = config.get("Cmd")
    return Imported(env=env, workdir=config.get("WorkingDir") or None,
                    user=config.get("User") or None, cmd=tuple(cmd) if cmd else None)


_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_DOCKER_LAYER_TYPES = frozenset({"application/vnd.docker.image.rootfs.diff.tar.gzip"})


# ----------------------------------------------------------------------------- workspaces


def import_path(src: Path, dest: Path | int) -> Imported:
    if not src.is_dir():
        raise SourceError(f"workspace source {src} is not a directory",
                          hint="fix source.path (relative to the definition file)")
    copy_source_tree(src, dest)
    return Imported()


def import_git(url: str, commit: str, dest: Path | int, scratch: Path,
               cancelled: threading.Event | None = None, *,
               strip_components: int = 0, dotgit: bool = False) -> Imported:
    """The tree of ``commit`` (already pinned) without ``.git``: ``git archive`` is
    deterministic, a clone's ``.git`` is not. With ``dotgit``, a ``.git`` holding that commit
    and nothing else is written next to it (``envbuild.build.gitdir``). ``url`` and ``commit``
    are checked again here (``check_git_source``) and can never reach git as options:
    ``--end-of-options`` precedes them and ``git_env`` restricts the transports."""
    check_git_source(url, commit)
    if not is_git_oid(commit):
        raise SourceError(f"git source {url}: {commit!r} is not a pinned commit id")
    env = git_env()
    repo = scratch / "git"
    init = ["git", "init", "-q", "--bare"]
    if dotgit:  # a SHA-256 source needs a SHA-256 scratch repository to fetch into
        init.append(f"--object-format={'sha256' if len(commit) == 64 else 'sha1'}")
    run_tool([*init, "--", str(repo)], "git init", env=env)
    run_tool(["git", "-C", str(repo), "-c", "protocol.ext.allow=never", "fetch", "-q", "--depth=1",
          "--end-of-options", url, commit], f"git fetch {url}", cancelled=cancelled, env=env)
    if dotgit:
        (repo / "info").mkdir(exist_ok=True)
        (repo / "info" / "attributes").write_text(gitdir.ARCHIVE_ATTRIBUTES)
    archive = scratch / "src.tar"
    run_tool(["git", "-C", str(repo), "archive", "--format=tar", "-o", str(archive),
          "--end-of-options", commit], f"git archive {commit}", env=env)
    extract_tar(archive, dest, f"git archive of {url}@{commit[:12]}",
                strip_components=strip_components)
    if dotgit:
        made, mtime = gitdir.build_dotgit(run_tool, repo, commit, scratch, env, cancelled)
        tar = scratch / "dotgit.tar"
        gitdir.write_dotgit_tar(made, tar, mtime)
        extract_tar(tar, dest, f".git of {url}@{commit[:12]}")
    return Imported()


def import_archive(path: Path, sha256: str, dest: Path | int, *,
                   strip_components: int = 0) -> Imported:
    if not path.is_file():
        raise SourceError(f"archive {path} does not exist")
    check_sha256(path, sha256, "archive")
    extract_tar(path, dest, f"archive {path.name}", strip_components=strip_components)
    return Imported()
