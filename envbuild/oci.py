"""OCI names envbuild writes and reads: media types, annotation keys and the digest grammar.

Both sides of the lock format use these: ``envbuild.plan.lockspec`` writes locks, the runtime
shim reads them. This module imports nothing of ours, so the dependency rule (runtime_shim
imports only layers, store, errors) stays meaningful: constants are not a dependency on
planning code.

A **digest** is ``sha256:`` and 64 lower-case hex digits, the only form envbuild writes or
accepts (``DIGEST_PATTERN``; ``is_digest``, ``digest_hex``). This is the one copy: every module
that checks or takes apart a digest uses it (``tests/unit/test_one_copy.py`` fails on a
second).
"""

import re
from typing import TypeGuard

#: The hex part of a digest: 64 lower-case hex digits (also a store's blob file name).
HEX64_PATTERN = "[0-9a-f]{64}"
#: A digest as envbuild writes and accepts it (a regular expression, for embedding).
DIGEST_PATTERN = f"sha256:{HEX64_PATTERN}"
#: ``DIGEST_PATTERN`` compiled, the hex part captured as group 1 (use ``fullmatch``).
DIGEST_RE = re.compile(f"sha256:({HEX64_PATTERN})")
HEX64_RE = re.compile(HEX64_PATTERN)


def is_digest(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a digest: ``sha256:`` and 64 lower-case hex digits, nothing else."""
    return isinstance(value, str) and DIGEST_RE.fullmatch(value) is not None


def digest_hex(value: object) -> str | None:
    """The 64 hex digits of digest ``value``, or None if it is not one."""
    m = DIGEST_RE.fullmatch(value) if isinstance(value, str) else None
    return m[1] if m else None


def is_hex64(value: str) -> bool:
    """Whether ``value`` is 64 lower-case hex digits (a digest's hex part)."""
    return HEX64_RE.fullmatch(value) is not None


MEDIA_TYPE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
#: layers re-encoded for tools that do not read zstd (``--compression gzip|none``)
MEDIA_TYPE_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_LAYER = "application/vnd.oci.image.layer.v1.tar"

#: sha256 of the layer's compressed TOC frame payload, as in its footer (docs/layer-format.md)
ANNOTATION_TOC = "org.envbuild.toc.digest"
#: base | workspace | toolkit | snapshot
ANNOTATION_ROLE = "org.envbuild.role"
#: the definition (or snapshot) that produced the layer
ANNOTATION_NAME = "org.envbuild.name"
#: the layer key the layer was built for
ANNOTATION_KEY = "org.envbuild.key"
#: on a lock manifest: the env it locks
ANNOTATION_ENV = "org.envbuild.env"
#: on a snapshot lock: the lock it was derived from
ANNOTATION_PARENT = "org.envbuild.parent.lock"
#: on a task lock (``runtime_shim.node.tasklock``): the env lock the agent gets; ``gc`` and
#: ``push`` follow it from the task manifest as they follow a layer
ANNOTATION_TASK_ENV = "org.envbuild.task.env.lock"
#: a task lock manifest's ``artifactType``
TASK_ARTIFACT_TYPE = "application/vnd.envbuild.task.v1"
#: on a lock config's Labels: the sandbox hostname
LABEL_HOSTNAME = "org.envbuild.hostname"
ANNOTATION_CREATED = "org.opencontainers.image.created"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
