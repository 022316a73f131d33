"""Locks (pure): an env's ordered layers + merged runtime config → an OCI manifest and config.

A lock *is* an OCI image: ``application/vnd.oci.image.manifest.v1+json`` whose layers are our
``tar+zstd`` blobs (base chain root first, then the workspace, then toolkits in the order the
Env lists them) and whose config carries ``rootfs.diff_ids`` and the merged ``Env``,
``WorkingDir``, ``User`` and ``Cmd``. Anything that reads OCI images (skopeo, umoci, podman)
reads a lock; the runtime shim reads the annotations below to find each layer's TOC without
opening the blob.

Annotations on each layer descriptor:

``org.envbuild.toc.digest``  sha256 of the layer's compressed TOC, as its footer records it
                             (docs/layer-format.md); readers check the TOC they fetch against it
``org.envbuild.role``        ``base`` | ``workspace`` | ``toolkit`` | ``snapshot``
``org.envbuild.name``        the definition that produced it
``org.envbuild.key``         the layer key it was built for

Config merge: every layer's ``config.env`` is applied in layer order over a default ``PATH``;
a value may reference variables set below it (``PATH: /opt/x/bin:$PATH``), expanded at lock
time so the lock is self-contained. The Env's own ``config`` is applied last. ``workdir``,
``user``, ``cmd`` and ``hostname``: the last layer (or the Env) that sets one wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envbuild.canonical import canonical_json
from envbuild.oci import (
    ANNOTATION_CREATED,
    ANNOTATION_ENV,
    ANNOTATION_KEY,
    ANNOTATION_NAME,
    ANNOTATION_ROLE,
    ANNOTATION_TOC,
    LABEL_HOSTNAME,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclasses.dataclass(frozen=True)
class LockLayer:
    """One layer of a lock, as recorded by the build (digests come from the key record)."""

    name: str
    role: str
    key: str
    digest: str
    diff_id: str
    size: int
    toc_digest: str


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """The part of a layer's or env's definition that ends up in the image config."""

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cmd: tuple[str, ...] | None = None
    hostname: str | None = None


@dataclasses.dataclass(frozen=True)
class Lock:
    """A lock ready to store: the two JSON documents, canonical bytes, and their digests."""

    env_name: str
    manifest: dict[str, Any]
    config: dict[str, Any]

    @property
    def config_bytes(self) -> bytes:
        return canonical_json(self.config)

    @property
    def manifest_bytes(self) -> bytes:
        return canonical_json(self.manifest)


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Expand ``$VAR`` and ``${VAR}`` from ``env``; unknown variables expand to ''."""
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)


def merge_config(configs: Sequence[RuntimeConfig]) -> RuntimeConfig:
    env: dict[str, str] = {"PATH": DEFAULT_PATH}
    workdir = user = hostname = None
    cmd = None
    for c in configs:
        for k, v in c.env.items():
            env[k] = expand(v, env)
        workdir = c.workdir or workdir
        user = c.user or user
        cmd = c.cmd if c.cmd is not None else cmd
        hostname = c.hostname or hostname
    return RuntimeConfig(env=env, workdir=workdir, user=user, cmd=cmd, hostname=hostname)


def make_lock(
    env_name: str,
    layers: Sequence[LockLayer],
    config: RuntimeConfig,
    *,
    created: str = "1970-01-01T00:00:00Z",
    annotations: Mapping[str, str] | None = None,
) -> Lock:
    """The OCI image for an env. Deterministic: same inputs, same manifest digest."""
    image_config: dict[str, Any] = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": [f"{k}={v}" for k, v in config.env.items()],
            "WorkingDir": config.workdir or "/",
            "User": config.user or "0:0",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": f"envbuild {layer.role} {layer.name}"}
                    for layer in layers],
    }
    if config.cmd is not None:
        image_config["config"]["Cmd"] = list(config.cmd)
    if config.hostname:
        image_config["config"]["Labels"] = {LABEL_HOSTNAME: config.hostname}
    config_bytes = canonical_json(image_config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": {"mediaType": MEDIA_TYPE_CONFIG, "digest": sha256_digest(config_bytes),
                   "size": len(config_bytes)},
        "layers": [
            {"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": layer.digest, "size": layer.size,
             "annotations": {ANNOTATION_TOC: layer.toc_digest, ANNOTATION_ROLE: layer.role,
                             ANNOTATION_NAME: layer.name, ANNOTATION_KEY: layer.key}}
            for layer in layers
        ],
        "annotations": {ANNOTATION_ENV: env_name, ANNOTATION_CREATED: created,
                        **dict(annotations or {})},
    }
    return Lock(env_name=env_name, manifest=manifest, config=image_config)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
