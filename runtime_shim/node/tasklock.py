"""Task locks: what a grader needs of a task, in the store, by digest (issue 35).

A task lock is an OCI image manifest with ``artifactType`` ``TASK_ARTIFACT_TYPE`` (an OCI 1.1
artifact, so every store kind — local layout, S3, registry — holds and copies it as it holds a
lock):

- its **config** is the grading spec (``TaskSpec``, canonical JSON, media type
  ``MEDIA_TYPE_TASK_CONFIG``, ``version`` ``TASK_LOCK_VERSION``): the task's name, the digest
  of the env lock the agent gets, the workdir, the grade command, the paths the agent may
  change, the tests that must pass or keep passing and where their JUnit report is written;
- its one **layer** is the hidden layer (the task's ``hidden`` source at ``workdir``, built as a
  workspace layer is), laid over the agent's changes in the grading sandbox only;
- the annotation ``ANNOTATION_TASK_ENV`` repeats the env lock's digest, so that ``gc`` and
  ``push`` reach the env lock from the manifest alone.

The hidden layer is in no env lock: a sandbox made from a task ref (``resolve`` follows it to
its env lock) never sees it. ``envbuild lock TASK`` writes task locks under ``task/NAME``;
``load_task`` reads one back, checked, bounded like every lock.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from typing import Any

from envbuild.errors import LockNotFound, RuntimeShimError
from envbuild.oci import (  # the store's gc and sync follow these two: defined there
    ANNOTATION_NAME,
    ANNOTATION_ROLE,
    ANNOTATION_TASK_ENV,
    ANNOTATION_TOC,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
    TASK_ARTIFACT_TYPE,
    is_digest,
)
from envbuild.store import Store, get_json, put_json

TASK_LOCK_VERSION = "envbuild.task.v1"
MEDIA_TYPE_TASK_CONFIG = "application/vnd.envbuild.task.config.v1+json"
#: on the hidden layer's descriptor: its diff_id (a task lock has no image config to hold it)
ANNOTATION_DIFF_ID = "org.envbuild.diff_id"
#: the ref a task lock is published under
TASK_REF_PREFIX = "task/"
#: a task spec is a few KB; a bigger config named as one is refused before it is parsed
MAX_TASK_JSON = 1 << 20


@dataclasses.dataclass(frozen=True)
class HiddenLayer:
    """The hidden layer's descriptor (as a lock's layer: enough to fetch and unpack it)."""

    digest: str
    size: int
    diff_id: str
    toc_digest: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """How a task is graded (the task lock's config). Paths are absolute and normalised:
    ``editable`` the paths below ``workdir`` the agent may change (its change set keeps only
    regular files, and symlinks that stay inside, under them); ``junit`` where the grade
    command writes its JUnit XML report (never under ``editable``); ``allow`` the test-settings
    files (``conftest.py``, ``pytest.ini`` …) the task lets the agent change."""

    name: str
    env_lock: str
    workdir: str
    run: str
    timeout: float
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    user: str | None = None
    editable: tuple[str, ...] = ()
    must_pass: tuple[str, ...] = ()
    keep_passing: tuple[str, ...] = ()
    junit: str | None = None
    allow: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"version": TASK_LOCK_VERSION, "name": self.name, "env_lock": self.env_lock,
                "workdir": self.workdir,
                "grade": {"run": self.run, "timeout": self.timeout, "env": dict(self.env),
                          "user": self.user},
                "editable": list(self.editable or (self.workdir,)),
                "tests": {"must_pass": list(self.must_pass),
                          "keep_passing": list(self.keep_passing)},
                "junit": self.junit, "allow": list(self.allow)}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> TaskSpec:
        """The spec in ``doc`` (a task lock's config), or ``RuntimeShimError`` naming
        ``where`` for anything of another version or shape."""
        if not isinstance(doc, dict) or doc.get("version") != TASK_LOCK_VERSION:
            found = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
            raise RuntimeShimError(f"{where}: not a task lock of version {TASK_LOCK_VERSION} "
                                   f"(found {found!r})",
                                   hint="re-lock the task with this envbuild: envbuild lock TASK")
        try:
            grade, tests = doc["grade"], doc["tests"]
            spec = cls(name=_text(doc["name"]), env_lock=_text(doc["env_lock"]),
                       workdir=_path(doc["workdir"]), run=_text(grade["run"]),
                       timeout=float(grade["timeout"]),
                       env={_text(k): _text(v) for k, v in dict(grade["env"]).items()},
                       user=None if grade.get("user") is None else _text(grade["user"]),
                       editable=tuple(_path(p) for p in doc["editable"]),
                       must_pass=tuple(_text(t) for t in tests["must_pass"]),
                       keep_passing=tuple(_text(t) for t in tests["keep_passing"]),
                       junit=None if doc.get("junit") is None else _path(doc["junit"]),
                       allow=tuple(_path(p) for p in doc.get("allow") or ()))
        except (KeyError, TypeError, ValueError) as e:
            raise RuntimeShimError(f"{where}: task spec is not of the task lock's shape "
                                   f"({type(e).__name__}: {e})",
                                   hint="re-lock the task: envbuild lock TASK") from None
        if not is_digest(spec.env_lock) or not spec.editable or spec.timeout <= 0:
            raise RuntimeShimError(f"{where}: task spec names no env lock digest, no editable "
                                   "path or no positive timeout",
                                   hint="re-lock the task: envbuild lock TASK")
        return spec


def _text(value: Any) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise TypeError(f"not a string: {value!r:.80}")
    return value


def _path(value: Any) -> str:
    path = _text(value)
    if not path.startswith("/") or posixpath.normpath(path) != path or path.startswith("//"):
        raise ValueError(f"not an absolute normalised path: {path!r:.200}")
    return path


@dataclasses.dataclass(frozen=True)
class TaskLock:
    """A task lock read from a store: its digest, spec and hidden layer."""

    digest: str
    spec: TaskSpec
    hidden: HiddenLayer


def task_manifest(spec: TaskSpec, hidden: HiddenLayer, config: Mapping[str, Any],
                  ) -> dict[str, Any]:
    """The task lock's manifest (pure) for ``spec`` whose config blob is ``config``
    (a descriptor ``{mediaType, digest, size}``) and whose hidden layer is ``hidden``."""
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
            "artifactType": TASK_ARTIFACT_TYPE, "config": dict(config),
            "layers": [{"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": hidden.digest,
                        "size": hidden.size,
                        "annotations": {ANNOTATION_TOC: hidden.toc_digest,
                                        ANNOTATION_ROLE: "hidden",
                                        ANNOTATION_NAME: f"{spec.name}.hidden",
                                        ANNOTATION_DIFF_ID: hidden.diff_id}}],
            "annotations": {ANNOTATION_TASK_ENV: spec.env_lock, ANNOTATION_NAME: spec.name}}


def publish_task(store: Store, spec: TaskSpec, hidden: HiddenLayer, *,
                 ref: str | None = None) -> str:
    """Store ``spec``'s config, then its manifest, then (optionally) ``ref``; the manifest's
    digest. The env lock and the hidden layer must already be in ``store``."""
    config = put_json(store, spec.to_json(), media_type=MEDIA_TYPE_TASK_CONFIG)
    manifest = task_manifest(spec, hidden, {"mediaType": MEDIA_TYPE_TASK_CONFIG,
                                            "digest": config.digest, "size": config.size})
    digest = put_json(store, manifest, media_type=MEDIA_TYPE_MANIFEST).digest
    if ref:
        store.put_ref(ref, digest, media_type=MEDIA_TYPE_MANIFEST)
    return digest


def is_task_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and manifest.get("artifactType") == TASK_ARTIFACT_TYPE


def task_env_lock(manifest: Mapping[str, Any]) -> str | None:
    """The env lock a task lock's manifest names (its annotation), or None."""
    value = (manifest.get("annotations") or {}).get(ANNOTATION_TASK_ENV)
    return value if is_digest(value) else None


def load_task(store: Store, ref_or_digest: str) -> TaskLock:
    """The task lock ``ref_or_digest`` names (``task/NAME``, a bare task name, or a digest),
    read and checked; ``LockNotFound`` if there is none, ``RuntimeShimError`` if what is there
    is not a task lock."""
    from envbuild.errors import BlobNotFound, RefNotFound

    digest = ref_or_digest
    if not is_digest(ref_or_digest):
        # a bare name is a task's; a ref of another kind (env/NAME) is read, then refused
        ref = ref_or_digest if "/" in ref_or_digest else TASK_REF_PREFIX + ref_or_digest
        try:
            digest = store.get_ref(ref).digest
        except RefNotFound:
            tasks = [r for r in store.list_refs() if r.startswith(TASK_REF_PREFIX)]
            raise LockNotFound(f"no task lock named {ref_or_digest!r} in {store!r}",
                               hint=f"task locks there: {', '.join(tasks[:10]) or 'none'}; "
                                    "make one with `envbuild lock TASK`") from None
    try:
        manifest = get_json(store, digest, max_size=MAX_TASK_JSON)
    except BlobNotFound:
        raise LockNotFound(f"no task lock {digest} in {store!r}",
                           hint="envbuild lock TASK prints a task lock's digest") from None
    if not is_task_manifest(manifest):
        raise RuntimeShimError(f"{ref_or_digest} is not a task lock (an env lock or another "
                               "manifest)", hint="grade by the task's ref, task/NAME, or the "
                                                 "digest `envbuild lock TASK` printed")
    try:
        layer = manifest["layers"][0]
        notes = layer["annotations"]
        hidden = HiddenLayer(digest=layer["digest"], size=int(layer["size"]),
                             diff_id=notes[ANNOTATION_DIFF_ID],
                             toc_digest=notes[ANNOTATION_TOC])
        config_digest = manifest["config"]["digest"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise RuntimeShimError(f"task lock {digest}: manifest is not of the task lock's shape",
                               hint="re-lock the task: envbuild lock TASK") from None
    if not all(map(is_digest, (hidden.digest, hidden.diff_id, hidden.toc_digest,
                               config_digest))):
        raise RuntimeShimError(f"task lock {digest}: a descriptor is not a sha256 digest",
                               hint="re-lock the task: envbuild lock TASK")
    spec = TaskSpec.from_json(get_json(store, config_digest, max_size=MAX_TASK_JSON),
                              f"task lock {digest}")
    if task_env_lock(manifest) != spec.env_lock:
        raise RuntimeShimError(f"task lock {digest}: its annotation and its spec name "
                               "different env locks", hint="re-lock the task: envbuild lock TASK")
    return TaskLock(digest=digest, spec=spec, hidden=hidden)
