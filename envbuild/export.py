"""``envbuild export``: write a lock as an image for consumers outside envbuild.

Targets use the transport syntax of skopeo and podman (``containers-transports(5)``):

- ``oci:DIR[:TAG]``: an OCI image layout directory; the manifest is tagged ``TAG``
  (``org.opencontainers.image.ref.name`` in ``index.json``). An existing layout keeps its other
  images: blobs are added (each written beside and renamed into place) and ``index.json`` is
  replaced in one rename; a missing ``DIR`` is built beside and renamed into place.
- ``oci-archive:FILE[:TAG]``: the same layout as a tar file.
- ``docker-archive:FILE[:NAME[:TAG]]``: the ``docker save`` format (``manifest.json`` with
  ``Config``/``RepoTags``/``Layers``, the config as ``<hex>.json``, each layer as
  ``<hex>.tar``), read by ``docker load``, ``podman load`` and skopeo. Its layers must be plain
  tar or gzip (no reader of the format knows zstd).

A task lock (``task/NAME``) is not an image: it is refused, naming its env lock; ``envbuild
push task/NAME --to DIR`` copies it with everything it names into an OCI layout.

``TAG`` defaults to the env name (``env/busybox-shell`` → ``busybox-shell``); a
docker-archive name without ``:TAG`` gets ``:latest``. The path ends at the first ``:``.

Compression (``--compression``): ``zstd`` (default for ``oci``/``oci-archive``) copies the
lock's blobs byte for byte: same digests, and envbuild's TOC annotations stay valid. ``gzip``
and ``none`` re-encode every layer as ``envbuild push --compression`` does
(``envbuild.store.recompress``: new layer digests, no TOC annotations, the same config).
``none`` is the default for ``docker-archive``.

Every output is written beside its final name and renamed into place: an export that fails
leaves nothing half written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from envbuild.atomic import atomic_file, write_atomic
from envbuild.errors import DigestMismatch, SettingsError, StoreError
from envbuild.oci import (  # noqa: F401  (MEDIA_TYPE_LAYER*: re-exported)
    ANNOTATION_REF_NAME,
    ANNOTATION_TASK_ENV,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_MANIFEST,
    TASK_ARTIFACT_TYPE,
)
from envbuild.store import Store
from envbuild.store.helpers import get_json, read_bytes
from envbuild.store.progress import TransferMeter, track
from envbuild.store.recompress import (  # noqa: F401  (COMPRESSIONS: re-exported)
    COMPRESSIONS,
    check_compression,
    lock_parts,
    manifest_bytes,
    reencode,
    reencoded_descriptor,
)

TRANSPORTS = ("oci", "oci-archive", "docker-archive")
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ExportTarget:
    """Where an export goes: ``transport:path[:tag]`` parsed."""

    transport: str
    path: Path
    tag: str | None

    def __str__(self) -> str:
        return f"{self.transport}:{self.path}" + (f":{self.tag}" if self.tag else "")


@dataclasses.dataclass(frozen=True)
class ExportRequest:
    ref: str                   # the ref of the lock in the store (``env/NAME``)
    target: ExportTarget
    compression: str | None = None  # None: the transport's default


@dataclasses.dataclass(frozen=True)
class ExportReport:
    target: str
    tag: str
    manifest_digest: str
    compression: str
    layers: tuple[tuple[str, str], ...]   # (digest in the lock, digest written)
    bytes_written: int

    @property
    def reencoded(self) -> bool:
        return self.compression != "zstd"

    def summary(self) -> str:
        text = (f"exported to {self.target} (tag {self.tag}, {len(self.layers)} layers, "
                f"{self.bytes_written} bytes")
        if self.reencoded:
            text += (f"; layers re-encoded as {'plain tar' if self.compression == 'none' else 'gzip'}"
                     ": their digests changed and the envbuild TOC annotations were dropped, "
                     "so envbuild reads these layers only by full unpack, not lazily")
        return text + ")"


def parse_target(text: str) -> ExportTarget:
    """``oci:DIR[:TAG]`` | ``oci-archive:FILE[:TAG]`` | ``docker-archive:FILE[:NAME[:TAG]]``."""
    transport, sep, rest = text.partition(":")
    if not sep or transport not in TRANSPORTS or not rest:
        raise SettingsError(f"export target {text!r} is not TRANSPORT:PATH[:TAG]",
                            hint="use oci:DIR:TAG, oci-archive:FILE:TAG or "
                                 "docker-archive:FILE:NAME[:TAG]")
    path, _, tag = rest.partition(":")
    if not path:
        raise SettingsError(f"export target {text!r} names no path")
    if tag:
        _check_tag(transport, tag, text)
    return ExportTarget(transport, Path(path), tag or None)


def _check_tag(transport: str, tag: str, text: str) -> None:
    import re

    if transport == "docker-archive":
        name, _, t = tag.rpartition(":") if ":" in tag else (tag, "", "latest")
        ok = (re.fullmatch(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*",
                           name) is not None
              and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", t) is not None)
        what = "a docker reference NAME[:TAG] (lower-case name)"
    else:
        ok = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", tag) is not None
        what = "a tag ([A-Za-z0-9_][A-Za-z0-9._-]*, at most 128 characters)"
    if not ok:
        raise SettingsError(f"export target {text!r}: {tag!r} is not {what}")


def export_lock(store: Store, request: ExportRequest,
                meter: TransferMeter | None = None) -> ExportReport:
    """Write the lock ``request.ref`` of ``store`` to ``request.target`` (module docstring).
    ``meter`` counts the bytes of the lock's layers read from ``store``."""
    target = request.target
    compression = _compression(request)
    desc = store.get_ref(request.ref)
    if desc.media_type != MEDIA_TYPE_MANIFEST:
        raise StoreError(f"{request.ref} is a {desc.media_type}, not an image manifest",
                         hint="export exports env locks (env/NAME)")
    manifest = get_json(store, desc.digest)
    if manifest.get("artifactType") == TASK_ARTIFACT_TYPE:
        env = (manifest.get("annotations") or {}).get(ANNOTATION_TASK_ENV, "its env lock")
        raise StoreError(f"{request.ref} is a task lock (an OCI artifact: a grading spec and a "
                         f"hidden layer), not an image; the image its agent gets is {env}",
                         hint="export the env (envbuild export ENV), or copy the task lock "
                              "with all it names into an OCI layout: envbuild push "
                              f"{request.ref} --to DIR")
    config_desc = manifest.get("config") or {}
    config_bytes = read_bytes(store, config_desc["digest"])
    parts = lock_parts(manifest, json.loads(config_bytes), request.ref)
    tag = target.tag or request.ref.rpartition("/")[2]
    if target.transport == "docker-archive" and ":" not in tag:
        tag += ":latest"
    _check_tag(target.transport, tag, str(target))
    if meter is not None:
        meter.expect(sum(int(layer.get("size", 0)) for layer, _ in parts))

    writer: _Out = (_LayoutDir(target.path) if target.transport == "oci"
                    else _Archive(target.path))
    try:
        new_layers = [_write_layer(store, writer, layer, diff_id, compression, meter)
                      for layer, diff_id in parts]
        if isinstance(writer, _Archive) and target.transport == "docker-archive":
            manifest_digest = _write_docker(writer, config_desc["digest"], config_bytes,
                                            [(d["digest"], diff) for d, (_, diff)
                                             in zip(new_layers, parts)], tag)
        else:
            writer.blob(io.BytesIO(config_bytes), expect=config_desc["digest"])
            out = (read_bytes(store, desc.digest) if compression == "zstd"
                   else manifest_bytes(manifest, new_layers))
            manifest_digest, msize = writer.blob(io.BytesIO(out))
            writer.tag(tag, {"mediaType": MEDIA_TYPE_MANIFEST, "digest": manifest_digest,
                             "size": msize})
        total = writer.commit()
    except OSError as e:
        writer.abort()
        raise StoreError(f"write {target}: {e.strerror or e}",
                         hint=f"check that {target.path.parent} is writable and has room") from e
    except BaseException:
        writer.abort()
        raise
    pairs = tuple((layer["digest"], new["digest"]) for (layer, _), new in zip(parts, new_layers))
    return ExportReport(str(target), tag, manifest_digest, compression, pairs, total)


def _compression(request: ExportRequest) -> str:
    """The compression asked for, or the transport's default; refused where it cannot go."""
    target = request.target
    compression = check_compression(request.compression or (
        "none" if target.transport == "docker-archive" else "zstd"))
    if target.transport == "docker-archive" and compression == "zstd":
        raise SettingsError("docker-archive cannot hold zstd layers (docker load, podman load "
                            "and skopeo read plain or gzip tar there)",
                            hint="use --compression gzip or --compression none")
    return compression


def _write_layer(store: Store, writer: _Out, layer: dict, diff_id: str, compression: str,
                 meter: TransferMeter | None) -> dict:
    """Write one layer as it is (``zstd``) or re-encoded; its descriptor in the output."""
    with store.get(layer["digest"]) as src:
        src = track(meter, src)
        if compression == "zstd":
            writer.blob(src, expect=layer["digest"])
            return dict(layer)
        digest, size = writer.blob(reencode(src, compression, diff_id, layer["digest"]))
    return reencoded_descriptor(layer, compression, digest, size)


def _write_docker(writer: _Archive, config_digest: str, config_bytes: bytes,
                  layers: list[tuple[str, str]], tag: str) -> str:
    """The ``docker save`` layout: config ``<hex>.json``, layers ``<hex>.tar``, and
    ``manifest.json``; returns the config digest (docker's image id)."""
    config_name = config_digest.removeprefix("sha256:") + ".json"
    writer.file(config_name, config_bytes)
    names = []
    for digest, _diff in layers:
        name = digest.removeprefix("sha256:") + ".tar"
        writer.rename_blob(digest, name)
        names.append(name)
    doc = [{"Config": config_name, "RepoTags": [tag], "Layers": names}]
    writer.file("manifest.json", json.dumps(doc, separators=(",", ":")).encode())
    return config_digest


class _Out:
    def blob(self, data, expect: str | None = None) -> tuple[str, int]:
        raise NotImplementedError

    def tag(self, tag: str, desc: dict) -> None:
        raise NotImplementedError

    def commit(self) -> int:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


def _write_blob(dirpath: Path, data, expect: str | None) -> tuple[str, int, Path]:
    """Write ``data`` (a file object or an iterator of bytes) to a temporary file in
    ``dirpath``; return its digest, size and path (verified against ``expect``)."""
    fd, tmp = tempfile.mkstemp(prefix=".export-", dir=dirpath)
    h = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            chunks = iter(lambda: data.read(_CHUNK), b"") if hasattr(data, "read") else data
            for chunk in chunks:
                h.update(chunk)
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.chmod(tmp, 0o644 & ~_umask())  # mkstemp makes 0600; outputs are for other tools
    digest = "sha256:" + h.hexdigest()
    if expect is not None and digest != expect:
        os.unlink(tmp)
        raise DigestMismatch(f"blob {expect} read back as {digest}")
    return digest, size, Path(tmp)


class _LayoutDir(_Out):
    """An OCI layout directory, new (built beside, renamed into place) or existing (blobs
    added, ``index.json`` replaced)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.added: list[Path] = []
        self.total = 0
        self.tags: dict[str, dict] = {}
        try:
            if path.exists():
                if not (path / "oci-layout").is_file():
                    if not path.is_dir() or any(path.iterdir()):
                        raise StoreError(f"{path} exists and is not an OCI layout",
                                         hint="name a new directory or an OCI layout")
                self.root = path
                self.fresh = False
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.root = Path(tempfile.mkdtemp(prefix=f".{path.name}.export-",
                                                  dir=path.parent))
                os.chmod(self.root, 0o755 & ~_umask())
                self.fresh = True
            (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"create OCI layout {path}: {e.strerror}") from e

    def blob(self, data, expect: str | None = None) -> tuple[str, int]:
        blobs = self.root / "blobs" / "sha256"
        digest, size, tmp = _write_blob(blobs, data, expect)
        final = blobs / digest.removeprefix("sha256:")
        if final.exists():
            tmp.unlink()
        else:
            os.rename(tmp, final)
            self.added.append(final)
        self.total += size
        return digest, size

    def tag(self, tag: str, desc: dict) -> None:
        self.tags[tag] = desc

    def commit(self) -> int:
        index_path = self.root / "index.json"
        try:
            index = json.loads(index_path.read_text()) if index_path.exists() else {}
        except (OSError, ValueError) as e:
            raise StoreError(f"read {index_path}: {e}", hint="fix or remove the layout") from e
        manifests = [m for m in index.get("manifests") or []
                     if (m.get("annotations") or {}).get(ANNOTATION_REF_NAME) not in self.tags]
        for tag, desc in self.tags.items():
            manifests.append({**desc, "annotations": {ANNOTATION_REF_NAME: tag}})
        index = {**index, "schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX,
                 "manifests": manifests}
        layout = self.root / "oci-layout"
        if not layout.exists():
            write_atomic(layout, b'{"imageLayoutVersion":"1.0.0"}')
        write_atomic(index_path, json.dumps(index, indent=1).encode())
        if self.fresh:
            os.rename(self.root, self.path)
        return self.total

    def abort(self) -> None:
        if self.fresh:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # blobs this export added; blobs that were there stay
            for p in self.added:
                with contextlib.suppress(OSError):
                    p.unlink()


class _Archive(_Out):
    """A tar file built from a staging directory beside it, then renamed into place: an OCI
    layout (``oci-archive``) or the ``docker save`` format (``docker-archive``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                raise StoreError(f"{path} is a directory", hint="name a file for the archive")
            self.stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.export-",
                                               dir=path.parent))
        except OSError as e:
            raise StoreError(f"create {path}: {e.strerror}") from e
        self.layout = _LayoutDir(self.stage / "layout")
        self.files: dict[str, Path] = {}
        self.docker = False

    def blob(self, data, expect: str | None = None) -> tuple[str, int]:
        return self.layout.blob(data, expect)

    def tag(self, tag: str, desc: dict) -> None:
        self.layout.tag(tag, desc)

    def file(self, name: str, data: bytes) -> None:
        self.docker = True
        p = self.stage / name
        p.write_bytes(data)
        self.files[name] = p

    def rename_blob(self, digest: str, name: str) -> None:
        self.docker = True
        self.files[name] = self.layout.root / "blobs" / "sha256" / digest.removeprefix("sha256:")

    def commit(self) -> int:
        if not self.docker:
            self.layout.commit()
        try:
            with atomic_file(self.path, mode=0o644, fsync=True) as f:
                with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    if self.docker:
                        for name, p in self.files.items():
                            _add(tar, p, name)
                    else:
                        root = self.layout.path
                        for name in ("oci-layout", "index.json"):
                            _add(tar, root / name, name)
                        for p in sorted((root / "blobs" / "sha256").iterdir()):
                            _add(tar, p, f"blobs/sha256/{p.name}")
        finally:
            shutil.rmtree(self.stage, ignore_errors=True)
        return self.path.stat().st_size

    def abort(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


def _add(tar: tarfile.TarFile, path: Path, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.size = path.stat().st_size
    info.mode = 0o644
    info.mtime = 0
    with open(path, "rb") as f:
        tar.addfile(info, f)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
