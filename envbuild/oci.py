"""OCI names envbuild writes and reads: media types and annotation keys (constants only).

Both sides of the lock format use these: ``envbuild.plan.lockspec`` writes locks, the runtime
shim reads them. This module imports nothing, so the dependency rule (runtime_shim imports only
layers, store, errors) stays meaningful: constants are not a dependency on planning code.
"""

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
#: on a lock config's Labels: the sandbox hostname
LABEL_HOSTNAME = "org.envbuild.hostname"
ANNOTATION_CREATED = "org.opencontainers.image.created"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
