"""Build foreign OCI images (layers that are plain, gzip or zstd tars, not envbuild's format)
in an OCI layout directory, for the tests of issue 16, item 3."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

MT = "application/vnd.oci.image.layer.v1."


def layer_tar(build: Callable[[tarfile.TarFile], None]) -> bytes:
    """A tar (PAX) built by ``build(tarfile)``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        build(tar)
    return buf.getvalue()


def add_file(tar: tarfile.TarFile, name: str, data: bytes = b"", mode: int = 0o644,
             **kw) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    for k, v in kw.items():
        setattr(info, k, v)
    tar.addfile(info, io.BytesIO(data))


def add_entry(tar: tarfile.TarFile, name: str, kind: bytes, linkname: str = "",
              mode: int = 0o755, **kw) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    for k, v in kw.items():
        setattr(info, k, v)
    tar.addfile(info)


def _put(layout: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest[7:]).write_bytes(data)
    return digest


def add_image(layout: Path, tag: str, base_tag: str | None, tars: Sequence[tuple[bytes, str]],
              *, tamper: bool = False, extra_env: Sequence[str] = ()) -> str:
    """Tag ``tag`` in ``layout``: the layers of ``base_tag`` (if any) plus ``tars``, each
    ``(tar bytes, "tar" | "tar+gzip")``; ``extra_env`` is added to the config's Env.
    ``tamper``: the last layer's blob is rewritten after the manifest names it (a digest
    mismatch). Returns the manifest digest."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    layers, diff_ids, config = [], [], {"architecture": "amd64", "os": "linux",
                                         "config": {"Env": ["PATH=/usr/bin:/bin"]},
                                         "rootfs": {"type": "layers", "diff_ids": []}}
    if base_tag is not None:
        [desc] = [m for m in index["manifests"]
                  if m["annotations"]["org.opencontainers.image.ref.name"] == base_tag]
        base = json.loads((layout / "blobs/sha256" / desc["digest"][7:]).read_bytes())
        layers = list(base["layers"])
        config = json.loads((layout / "blobs/sha256" / base["config"]["digest"][7:])
                            .read_bytes())
        diff_ids = list(config["rootfs"]["diff_ids"])
    last = None
    for data, kind in tars:
        blob = gzip.compress(data, mtime=0) if kind == "tar+gzip" else data
        last = _put(layout, blob)
        layers.append({"mediaType": MT + kind, "digest": last, "size": len(blob)})
        diff_ids.append("sha256:" + hashlib.sha256(data).hexdigest())
    config = {**config, "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    if extra_env:
        config["config"] = {**config.get("config", {}),
                            "Env": list(config.get("config", {}).get("Env", [])) + list(extra_env)}
    config_bytes = json.dumps(config).encode()
    cdigest = _put(layout, config_bytes)
    manifest = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": cdigest, "size": len(config_bytes)},
                           "layers": layers}).encode()
    mdigest = _put(layout, manifest)
    index["manifests"] = [m for m in index["manifests"]
                          if m["annotations"]["org.opencontainers.image.ref.name"] != tag]
    index["manifests"].append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                               "digest": mdigest, "size": len(manifest),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
    index_path.write_text(json.dumps(index))
    if tamper and last is not None:
        p = layout / "blobs/sha256" / last[7:]
        data = bytearray(p.read_bytes())
        data[-30] ^= 0x01
        p.write_bytes(bytes(data))
    return mdigest


def add_index(layout: Path, tag: str, entries: Sequence[tuple[str, str]]) -> str:
    """Tag ``tag``: an OCI index of ``(manifest tag, "os/arch")`` entries. Returns its digest."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    by_tag = {m["annotations"]["org.opencontainers.image.ref.name"]: m
              for m in index["manifests"]}
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
           "manifests": []}
    for t, plat in entries:
        os_name, _, arch = plat.partition("/")
        d = by_tag[t]
        doc["manifests"].append({"mediaType": d["mediaType"], "digest": d["digest"],
                                 "size": d["size"],
                                 "platform": {"os": os_name, "architecture": arch}})
    data = json.dumps(doc).encode()
    digest = _put(layout, data)
    index["manifests"] = [m for m in index["manifests"]
                          if m["annotations"]["org.opencontainers.image.ref.name"] != tag]
    index["manifests"].append({"mediaType": doc["mediaType"], "digest": digest,
                               "size": len(data),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
    index_path.write_text(json.dumps(index))
    return digest
