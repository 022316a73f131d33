"""Source importers: put a layer's starting files into a directory (side effects).

One small function per source kind. Each writes into ``dest`` (an empty directory, or for a
workspace the ``dest`` path inside the build rootfs) and returns an ``Imported`` with whatever
runtime config the source carries (only ``oci`` images have one). Integrity is checked here:
a declared ``sha256`` is enforced before a single byte is extracted.

Trust: definitions and their sources are written by the people who own the repo, so archives
are extracted with GNU tar as root (owners, modes and xattrs kept). Untrusted input — a
sandbox's changes — never comes through here; it goes through pack-diff's policy instead.
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
from collections.abc import Iterable, Mapping
from pathlib import Path

# Shared with envbuild.build.pin's tree hash: what is not hashed must not be copied either,
# or a key would not describe its layer.
from envbuild.build.pin import IGNORED_DIR_NAMES, IGNORED_FILE_SUFFIXES, IGNORED_NAMES
from envbuild.canonical import read_json_file
from envbuild.errors import BuildError, SourceError


@dataclasses.dataclass(frozen=True)
class Imported:
    """Config a source brings along (an OCI image's Env, WorkingDir, User, Cmd)."""

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cmd: tuple[str, ...] | None = None


def _run(argv: list[str], what: str, *, cwd: str | None = None,
         cancelled: threading.Event | None = None, stdout=subprocess.PIPE,
         stderr=subprocess.PIPE) -> str:
    """Run a tool to completion; a set ``cancelled`` event (Ctrl-C / SIGTERM of the build)
    kills its whole process group within ~0.1 s instead of waiting for, say, debootstrap."""
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, start_new_session=True)
    except FileNotFoundError:
        raise BuildError(f"{what}: {argv[0]} is not installed",
                         hint="run scripts/setup.sh to install the tools envbuild drives") from None
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


def import_busybox(binary: Path, dest: Path) -> Imported:
    """A minimal rootfs: the static busybox binary, a link per applet, and the FHS skeleton.

    Applet locations come from ``busybox --list-full`` (``usr/bin/awk``, ``sbin/ip`` …), so the
    result looks like a busybox-based distribution. The binary must be static: it is executed
    on the host to list its applets and later inside containers with no libc.
    """
    if not binary.is_file():
        raise SourceError(f"busybox binary {binary} not found",
                          hint="apt-get install busybox-static, or set from.busybox.binary")
    listing = _run([str(binary), "--list-full"], "list busybox applets")
    for d, mode in (("bin", 0o755), ("sbin", 0o755), ("usr/bin", 0o755), ("usr/sbin", 0o755),
                    ("etc", 0o755), ("root", 0o700), ("tmp", 0o1777), ("proc", 0o555),
                    ("sys", 0o555), ("dev", 0o755), ("var/tmp", 0o1777), ("home", 0o755)):
        (dest / d).mkdir(parents=True, exist_ok=True)
        os.chmod(dest / d, mode)
    shutil.copyfile(binary, dest / "bin" / "busybox")
    os.chmod(dest / "bin" / "busybox", 0o755)
    for applet in sorted(set(listing.split())):
        if applet in ("bin/busybox", "linuxrc") or "/" not in applet:
            continue
        target = dest / applet
        target.parent.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(dest / "bin" / "busybox", target.parent)
        if not target.exists() and not target.is_symlink():
            os.symlink(rel, target)
    return Imported()


def _tar_compression_flag(path: Path) -> list[str]:
    name = path.name.lower()
    if name.endswith((".tar.zst", ".tzst")):
        return ["--zstd"]
    if name.endswith((".tar.gz", ".tgz")):
        return ["-z"]
    if name.endswith((".tar.xz", ".txz")):
        return ["-J"]
    return []


def extract_tar(archive: Path, dest: Path, what: str, strip: int = 0) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    argv = ["tar", "-x", *_tar_compression_flag(archive), "-f", str(archive), "-C", str(dest),
            "--numeric-owner", "--same-owner", "-p", "--xattrs", "--xattrs-include=*"]
    if strip:
        argv.append(f"--strip-components={strip}")
    _run(argv, what)


def copy_tree(src: Path, dest: Path) -> None:
    """Copy a directory tree keeping modes, owners, symlinks, hardlinks and xattrs."""
    dest.mkdir(parents=True, exist_ok=True)
    _run(["cp", "-a", "--", f"{src}/.", str(dest)], f"copy {src}")


def copy_source_tree(src: Path, dest: Path) -> None:
    """Copy a source tree, leaving out exactly what the tree hash leaves out (``.git``,
    ``__pycache__``, ``*.pyc``), so the layer holds what its key describes."""
    dest.mkdir(parents=True, exist_ok=True)
    st = os.lstat(src)
    os.chmod(dest, st.st_mode & 0o7777)
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if entry.name in IGNORED_NAMES:
            continue
        if entry.is_dir(follow_symlinks=False):
            if entry.name in IGNORED_DIR_NAMES:
                continue
            copy_source_tree(Path(entry.path), dest / entry.name)
        elif entry.name.endswith(IGNORED_FILE_SUFFIXES):
            continue
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), dest / entry.name)
        else:
            shutil.copy2(entry.path, dest / entry.name, follow_symlinks=False)


def import_rootfs(path: Path, sha256: str | None, dest: Path) -> Imported:
    if path.is_dir():
        if sha256:
            raise SourceError(f"rootfs {path} is a directory; sha256 applies to tarballs only",
                              hint="remove sha256 (the directory is hashed as a tree)")
        copy_tree(path, dest)
    elif path.is_file():
        check_sha256(path, sha256, "rootfs")
        extract_tar(path, dest, f"extract rootfs {path.name}")
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
            _run(argv, f"debootstrap {suite}", cancelled=cancelled, stdout=out,
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
    # Debootstrap leaves caches and logs that differ run to run and serve no sandbox.
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = dest / junk
        if d.is_dir():
            for entry in os.scandir(d):
                if entry.is_file(follow_symlinks=False) and entry.name not in ("lock",):
                    os.unlink(entry.path)
    return Imported()


# ----------------------------------------------------------------------------- OCI images

_LAYER_MEDIA_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": [],
    "application/vnd.oci.image.layer.v1.tar+gzip": ["-z"],
    "application/vnd.oci.image.layer.v1.tar+zstd": ["--zstd"],
    "application/vnd.docker.image.rootfs.diff.tar.gzip": ["-z"],
    "application/vnd.docker.image.rootfs.diff.tar": [],
}


def _blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexpart):
        raise SourceError(f"OCI layout {layout}: unsupported digest {digest!r}")
    return layout / "blobs" / algo / hexpart


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


def _apply_whiteouts_before(layer_listing: list[str], dest: Path) -> list[Path]:
    """Delete what this layer's whiteouts hide in the tree below; return the marker paths.

    Deletions happen *before* the layer is extracted so an opaque directory keeps the entries
    the same layer adds to it.
    """
    markers = []
    for member in layer_listing:
        member = member.lstrip("./").rstrip("/")
        if not member:
            continue
        parent, _, base = member.rpartition("/")
        if not base.startswith(".wh."):
            continue
        if ".." in member.split("/"):
            raise SourceError(f"OCI layer member escapes the root: {member!r}")
        markers.append(dest / member)
        if base == ".wh..wh..opq":
            d = dest / parent
            if d.is_dir() and not d.is_symlink():
                for entry in os.scandir(d):
                    _remove(Path(entry.path))
        else:
            _remove(dest / parent / base[len(".wh."):])
    return markers


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def import_oci(layout: Path, ref: str, dest: Path) -> Imported:
    manifest = _read_json_blob(layout, resolve_oci_manifest(layout, ref))
    config = _read_json_blob(layout, manifest["config"]["digest"]).get("config") or {}
    dest.mkdir(parents=True, exist_ok=True)
    for layer in manifest.get("layers", []):
        flags = _LAYER_MEDIA_TYPES.get(layer.get("mediaType"))
        if flags is None:
            raise SourceError(f"OCI layout {layout}: layer media type {layer.get('mediaType')!r} "
                              "is not supported")
        path = _blob_path(layout, layer["digest"])
        check_sha256(path, layer["digest"], f"OCI layout {layout}")
        listing = _run(["tar", "-t", *flags, "-f", str(path)], f"list layer {layer['digest']}")
        markers = _apply_whiteouts_before(listing.splitlines(), dest)
        _run(["tar", "-x", *flags, "-f", str(path), "-C", str(dest), "--numeric-owner",
              "--same-owner", "-p", "--xattrs", "--xattrs-include=*"],
             f"extract layer {layer['digest']}")
        for m in markers:
            _remove(m)
    env = {}
    for item in config.get("Env") or []:
        k, _, v = item.partition("=")
        env[k] = v
    cmd = config.get("Cmd")
    return Imported(env=env, workdir=config.get("WorkingDir") or None,
                    user=config.get("User") or None, cmd=tuple(cmd) if cmd else None)


# ----------------------------------------------------------------------------- workspaces


def import_path(src: Path, dest: Path) -> Imported:
    if not src.is_dir():
        raise SourceError(f"workspace source {src} is not a directory",
                          hint="fix source.path (relative to the definition file)")
    copy_source_tree(src, dest)
    return Imported()


def import_git(url: str, commit: str, dest: Path, scratch: Path,
               cancelled: threading.Event | None = None) -> Imported:
    """The tree of ``commit`` (already pinned) without ``.git``: ``git archive`` is
    deterministic, a clone's ``.git`` is not."""
    repo = scratch / "git"
    _run(["git", "init", "-q", "--bare", str(repo)], "git init")
    _run(["git", "-C", str(repo), "fetch", "-q", "--depth=1", url, commit], f"git fetch {url}",
         cancelled=cancelled)
    archive = scratch / "src.tar"
    _run(["git", "-C", str(repo), "archive", "--format=tar", "-o", str(archive), commit],
         f"git archive {commit}")
    extract_tar(archive, dest, f"extract {url}@{commit[:12]}")
    return Imported()


def import_archive(path: Path, sha256: str, dest: Path) -> Imported:
    if not path.is_file():
        raise SourceError(f"archive {path} does not exist")
    check_sha256(path, sha256, "archive")
    extract_tar(path, dest, f"extract {path.name}")
    return Imported()
