"""The definition model: frozen dataclasses built from *validated* mappings.

The JSON Schemas in ``schema/`` decide what a valid document is; the loader validates first and
only then calls ``Base.from_mapping`` and friends, so constructors here may assume the shapes the
schema guarantees. Constructors are named and not polymorphic: one per kind, one per source.

Identity vs metadata: ``identity()`` returns exactly the fields that change what a layer contains.
Descriptions, labels and source locations are metadata and never reach a key; the planner adds
content digests of sources (a path tree, a git commit) on top of ``identity()``.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from envbuild.defs.steps import (  # noqa: F401  (CopyStep, RunStep, run_label: re-exported)
    CopyStep,
    RunStep,
    Step,
    run_label,
    step_from_mapping,
)
from envbuild.defs.steps import frozen_map as _frozen_map

API_VERSION = "envbuild/v1"
KINDS = ("Base", "Workspace", "Toolkit", "Env", "Task")
LAYER_KINDS = ("Base", "Workspace", "Toolkit")

Framing = Literal["lazy", "compact"]
Pin = Literal["abi", "digest"]


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a definition came from. Never part of a key.

    ``field_positions`` maps a document path (``"build_on"``, ``"toolkits[1]"``,
    ``"steps[0].run"``) to its 1-based (line, column), so later stages (the graph) can point
    at the exact line of a bad reference.
    """

    file: str
    line: int = 0
    column: int = 0
    field_positions: Mapping[str, tuple[int, int]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )

    @property
    def directory(self) -> Path:
        return Path(self.file).parent

    def position(self, path: str) -> tuple[int, int]:
        """Line and column of ``path`` inside the document, else of the document itself."""
        return self.field_positions.get(path, (self.line, self.column))


# ----------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class ScratchSource:
    """An empty root."""

    kind = "scratch"

    def identity(self) -> dict[str, Any]:
        return {"scratch": {}}


@dataclasses.dataclass(frozen=True)
class BaseSource:
    """``from: {base: NAME}``: stack on another Base's layer chain."""

    base: str
    kind = "base"

    def identity(self) -> dict[str, Any]:
        # The parent's *key* is added by the planner (a Base is an ordinary layer chain).
        return {"base": self.base}


@dataclasses.dataclass(frozen=True)
class DebootstrapSource:
    suite: str
    variant: str = "minbase"
    include: tuple[str, ...] = ()
    mirror: str | None = None  # None: the mirror this machine's apt uses
    kind = "debootstrap"

    def identity(self) -> dict[str, Any]:
        # The mirror is where bytes come from, not what they are: left out of the key.
        return {"debootstrap": {"suite": self.suite, "variant": self.variant,
                                "include": sorted(self.include)}}


@dataclasses.dataclass(frozen=True)
class RootfsSource:
    """A directory or a tar / tar.gz / tar.zst file; ``sha256`` is enforced when given."""

    path: str
    sha256: str | None = None
    kind = "rootfs"

    def identity(self) -> dict[str, Any]:
        return {"rootfs": {"sha256": self.sha256}}  # content digest added by the planner


@dataclasses.dataclass(frozen=True)
class OciSource:
    layout: str
    ref: str
    kind = "oci"

    def identity(self) -> dict[str, Any]:
        return {"oci": {"ref": self.ref}}  # manifest digest added by the planner


def host_platform() -> str:
    """``linux/<GOARCH>`` of this host, or ``$ENVBUILD_PLATFORM`` (``OS/ARCH``): the image an
    index resolves to (``from: {image}``); part of the layer's identity, so it keys it."""
    import os
    import platform

    override = os.environ.get("ENVBUILD_PLATFORM", "").strip()
    if override:
        return override
    machine = platform.machine()
    return "linux/" + {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm",
                       "ppc64le": "ppc64le", "s390x": "s390x"}.get(machine, machine)


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """A registry image, ``HOST[:PORT]/REPO@sha256:…`` (issue 16): content-addressed by its
    digest, so its identity is the digest and the platform an index resolves to; a ``:TAG``
    is refused at planning with the digest it resolves to."""

    ref: str
    platform: str = dataclasses.field(default_factory=host_platform)
    kind = "image"

    def split(self) -> tuple[str, str, str | None, str | None]:
        """``(host, repo, digest, tag)`` of ``ref``."""
        name, _, digest = self.ref.partition("@")
        host, _, path = name.partition("/")
        repo, tag = path, None
        if ":" in path.rpartition("/")[2]:
            repo, _, tag = path.rpartition(":")
        return host, repo, digest or None, tag

    def identity(self) -> dict[str, Any]:
        return {"image": {"digest": self.split()[2], "platform": self.platform}}


@dataclasses.dataclass(frozen=True)
class DockerfileSource:
    """``from: {dockerfile: ...}`` (issue 17): an image built by BuildKit from a Dockerfile in
    ``context`` (``envbuild.build.dockerfile``). The context's digest (``.dockerignore``
    applied), the Dockerfile's bytes and every ``FROM`` digest are pinned; ``args``,
    ``target`` and ``network`` are identity. The paths are not: the bytes are.

    ``envs``: the Envs of the same tree its ``FROM envbuild.invalid/env/NAME`` lines (no
    digest) name, filled in by the loader from the Dockerfile (``envbuild.defs.load``): each is
    an edge of the graph (built and locked first) and its lock *inputs* go into the key
    (``envbuild.plan.keys``), so it is not identity here."""

    context: str
    file: str = "Dockerfile"
    args: tuple[tuple[str, str], ...] = ()
    target: str | None = None
    network: str = "none"
    envs: tuple[str, ...] = ()
    kind = "dockerfile"

    def identity(self) -> dict[str, Any]:
        return {"dockerfile": {"args": dict(self.args), "target": self.target,
                               "network": self.network}}


@dataclasses.dataclass(frozen=True)
class BusyboxSource:
    """A tiny rootfs made of a static busybox binary and its applet links (for fast tests)."""

    binary: str = "/bin/busybox"
    kind = "busybox"

    def identity(self) -> dict[str, Any]:
        return {"busybox": {}}  # binary digest added by the planner


@dataclasses.dataclass(frozen=True)
class PathSource:
    """A directory, relative to the definition file; hashed as a tree."""

    path: str
    kind = "path"

    def identity(self) -> dict[str, Any]:
        return {"path": {}}  # tree digest added by the planner; the path itself is not identity


def _strip(identity: dict[str, Any], strip_components: int) -> dict[str, Any]:
    # Only when set: a source without it keeps the key it had before the field existed.
    if strip_components:
        identity["strip_components"] = strip_components
    return identity


@dataclasses.dataclass(frozen=True)
class GitSource:
    """A commit's tree (``git archive``); ``strip_components`` drops leading path components
    of every member, as ``tar --strip-components`` (members left with none are dropped);
    ``dotgit`` adds a ``.git`` holding that commit alone."""

    url: str
    rev: str
    strip_components: int = 0
    dotgit: bool = False  # ship a .git of the commit alone (envbuild.build.gitdir)
    kind = "git"

    def identity(self) -> dict[str, Any]:
        # resolved commit sha added by the planner
        identity = _strip({"url": self.url}, self.strip_components)  # dotgit only when set:
        return {"git": {**identity, "dotgit": True} if self.dotgit else identity}  # same keys


@dataclasses.dataclass(frozen=True)
class ArchiveSource:
    """A tarball (any compression) checked against ``sha256``; ``strip_components`` as for
    git: a PyPI sdist or a GitHub tarball holds one top directory, ``strip_components: 1``
    puts its contents straight into ``dest``."""

    path: str
    sha256: str
    strip_components: int = 0
    kind = "archive"

    def identity(self) -> dict[str, Any]:
        return {"archive": _strip({"sha256": self.sha256}, self.strip_components)}


BaseFrom = (ScratchSource | BaseSource | DebootstrapSource | RootfsSource | OciSource | BusyboxSource
            | ImageSource | DockerfileSource)
WorkspaceSource = PathSource | GitSource | ArchiveSource


def base_from_mapping(m: Mapping[str, Any]) -> BaseFrom:
    (kind, v), = m.items()
    if kind == "scratch":
        return ScratchSource()
    if kind == "base":
        return BaseSource(base=v)
    if kind == "debootstrap":
        return DebootstrapSource(suite=v["suite"], variant=v.get("variant", "minbase"),
                                 include=tuple(v.get("include", ())), mirror=v.get("mirror"))
    if kind == "rootfs":
        if isinstance(v, str):
            return RootfsSource(path=v)
        return RootfsSource(path=v["path"], sha256=v.get("sha256"))
    if kind == "oci":
        return OciSource(layout=v["layout"], ref=v["ref"])
    if kind == "busybox":
        return BusyboxSource(binary=(v or {}).get("binary", "/bin/busybox"))
    if kind == "image":  # registry issue (16): a base from a registry image
        return ImageSource(ref=v)
    if kind == "dockerfile":  # issue 17: a base built by BuildKit
        return DockerfileSource(context=v["context"], file=v.get("file", "Dockerfile"),
                                args=tuple(sorted((str(k), str(a)) for k, a in
                                                  (v.get("args") or {}).items())),
                                target=v.get("target"), network=v.get("network", "none"))
    raise ValueError(f"unknown base source {kind!r}")  # the schema rules this out


def workspace_source_from_mapping(m: Mapping[str, Any]) -> WorkspaceSource:
    (kind, v), = m.items()
    if kind == "path":
        return PathSource(path=v if isinstance(v, str) else v["path"])
    if kind == "git":
        return GitSource(url=v["url"], rev=v["rev"],
                         strip_components=int(v.get("strip_components", 0)),
                         dotgit=bool(v.get("dotgit", False)))
    if kind == "archive":
        return ArchiveSource(path=v["path"], sha256=v["sha256"],
                             strip_components=int(v.get("strip_components", 0)))
    raise ValueError(f"unknown workspace source {kind!r}")


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Config:
    """Runtime config a layer contributes to an env's lock (OCI image config fields).

    ``env`` values may reference ``$VAR`` of lower layers (``PATH: /opt/x/bin:$PATH``); the lock
    step expands them in layer order.
    """

    env: Mapping[str, str] = dataclasses.field(default_factory=lambda: _frozen_map(None))
    workdir: str | None = None
    user: str | None = None
    cmd: tuple[str, ...] | None = None
    hostname: str | None = None

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None) -> Config:
        m = m or {}
        cmd = m.get("cmd")
        if isinstance(cmd, str):
            cmd = ("/bin/sh", "-c", cmd)
        return cls(
            env=_frozen_map({k: str(v) for k, v in (m.get("env") or {}).items()}),
            workdir=m.get("workdir"),
            user=None if m.get("user") is None else str(m["user"]),
            cmd=None if cmd is None else tuple(cmd),
            hostname=m.get("hostname"),
        )

    def identity(self) -> dict[str, Any]:
        return {"env": dict(self.env), "workdir": self.workdir, "user": self.user,
                "cmd": None if self.cmd is None else list(self.cmd), "hostname": self.hostname}


# ----------------------------------------------------------------------------- kinds


@dataclasses.dataclass(frozen=True)
class _Common:
    name: str
    origin: Origin = dataclasses.field(compare=False, repr=False)
    description: str = dataclasses.field(default="", compare=False)
    labels: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: _frozen_map(None), compare=False, repr=False
    )


def _common(m: Mapping[str, Any], origin: Origin) -> dict[str, Any]:
    return {
        "name": m["name"],
        "origin": origin,
        "description": m.get("description", ""),
        "labels": _frozen_map(m.get("labels")),
    }


@dataclasses.dataclass(frozen=True)
class Base(_Common):
    abi: str = ""
    source: BaseFrom = dataclasses.field(default_factory=ScratchSource)
    steps: tuple[Step, ...] = ()
    config: Config = dataclasses.field(default_factory=Config)
    framing: Framing = "lazy"
    kind = "Base"

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], origin: Origin) -> Base:
        return cls(
            **_common(m, origin),
            abi=m["abi"],
            source=base_from_mapping(m["from"]),
            steps=tuple(step_from_mapping(s) for s in m.get("steps") or ()),
            config=Config.from_mapping(m.get("config")),
            framing=m.get("framing", "lazy"),
        )

    @property
    def parent(self) -> str | None:
        return self.source.base if isinstance(self.source, BaseSource) else None


@dataclasses.dataclass(frozen=True)
class Toolkit(_Common):
    build_on: str = ""
    prefix: str = ""
    requires_abi: tuple[str, ...] = ()  # empty: the abi of build_on
    steps: tuple[Step, ...] = ()
    config: Config = dataclasses.field(default_factory=Config)
    framing: Framing = "lazy"
    pin: Pin = "abi"
    kind = "Toolkit"

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], origin: Origin) -> Toolkit:
        return cls(
            **_common(m, origin),
            build_on=m["build_on"],
            prefix=m["prefix"].rstrip("/") or "/",
            requires_abi=tuple((m.get("requires") or {}).get("abi") or ()),
            steps=tuple(step_from_mapping(s) for s in m.get("steps") or ()),
            config=Config.from_mapping(m.get("config")),
            framing=m.get("framing", "lazy"),
            pin=m.get("pin", "abi"),
        )


#: Seconds a ``check:`` command may run when its entry names no ``timeout:``.
DEFAULT_CHECK_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class CheckCommand:
    """One ``check:`` entry: a ``/bin/sh -c`` command and its deadline in seconds. Written as
    a string (``DEFAULT_CHECK_TIMEOUT``) or ``{run: CMD, timeout: S}``. Never part of a key."""

    run: str
    timeout: float = DEFAULT_CHECK_TIMEOUT

    @classmethod
    def from_value(cls, v: str | Mapping[str, Any]) -> CheckCommand:
        if isinstance(v, str):
            return cls(run=v)
        return cls(run=v["run"], timeout=float(v.get("timeout", DEFAULT_CHECK_TIMEOUT)))


@dataclasses.dataclass(frozen=True)
class Workspace(_Common):
    build_on: str = ""
    source: WorkspaceSource = dataclasses.field(default_factory=lambda: PathSource("."))
    dest: str = "/workspace"
    requires_abi: tuple[str, ...] = ()  # empty: the abi of build_on
    steps: tuple[Step, ...] = ()
    check: tuple[CheckCommand, ...] = ()
    config: Config = dataclasses.field(default_factory=Config)
    framing: Framing = "lazy"
    pin: Pin = "abi"
    kind = "Workspace"

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], origin: Origin) -> Workspace:
        return cls(
            **_common(m, origin),
            build_on=m["build_on"],
            source=workspace_source_from_mapping(m["source"]),
            dest=m.get("dest", "/workspace"),
            requires_abi=tuple((m.get("requires") or {}).get("abi") or ()),
            steps=tuple(step_from_mapping(s) for s in m.get("steps") or ()),
            check=tuple(CheckCommand.from_value(c) for c in m.get("check") or ()),
            config=Config.from_mapping(m.get("config")),
            framing=m.get("framing", "lazy"),
            pin=m.get("pin", "abi"),
        )


@dataclasses.dataclass(frozen=True)
class Env(_Common):
    base: str = ""
    workspace: str | None = None
    toolkits: tuple[str, ...] = ()
    config: Config = dataclasses.field(default_factory=Config)
    kind = "Env"

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], origin: Origin) -> Env:
        return cls(
            **_common(m, origin),
            base=m["base"],
            workspace=m.get("workspace"),
            toolkits=tuple(m.get("toolkits") or ()),
            config=Config.from_mapping(m.get("config")),
        )


#: Seconds a task's ``grade.run`` may run when it names no ``timeout:``.
DEFAULT_GRADE_TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True)
class Grade:
    """A task's ``grade:``: the command run in the grading sandbox (``/bin/sh -c``, in the
    task's ``workdir``), its deadline in seconds, extra environment and user."""

    run: str
    timeout: float = DEFAULT_GRADE_TIMEOUT
    env: Mapping[str, str] = dataclasses.field(default_factory=lambda: _frozen_map(None))
    user: str | None = None  # None: the env's config.user

    def identity(self) -> dict[str, Any]:
        return {"run": self.run, "timeout": self.timeout, "env": dict(self.env),
                "user": self.user}


@dataclasses.dataclass(frozen=True)
class Task(_Common):
    """An env an agent works in and how its work is graded (issue 35). ``editable`` and
    ``junit`` are absolute and normalised (relative ones are under ``workdir``; no
    ``editable``: ``(workdir,)``); the loader checked that every ``editable`` path is under
    ``workdir`` and ``junit`` under none of them (``envbuild.defs.validate``). ``hidden`` is
    laid over ``workdir`` in the grading sandbox only (a source as a workspace's, pinned and
    built as one: ``envbuild.plan.taskplan``). ``allow``: test-settings files (absolute, under
    ``workdir``) the grader keeps in the agent's change set although they configure tests."""

    env: str = ""
    workdir: str = "/workspace"
    hidden: WorkspaceSource = dataclasses.field(default_factory=lambda: PathSource("."))
    grade: Grade = dataclasses.field(default_factory=lambda: Grade(run="true"))
    editable: tuple[str, ...] = ()
    must_pass: tuple[str, ...] = ()
    keep_passing: tuple[str, ...] = ()
    junit: str | None = None
    allow: tuple[str, ...] = ()  # test-settings files under workdir the agent may change
    kind = "Task"

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], origin: Origin) -> Task:
        g, tests, workdir = m["grade"], m.get("tests") or {}, posixpath.normpath(m["workdir"])
        return cls(
            **_common(m, origin), env=m["env"], workdir=workdir,
            hidden=workspace_source_from_mapping(m["hidden"]),
            grade=Grade(run=g["run"], timeout=float(g.get("timeout", DEFAULT_GRADE_TIMEOUT)),
                        env=_frozen_map({k: str(v) for k, v in (g.get("env") or {}).items()}),
                        user=None if g.get("user") is None else str(g["user"])),
            editable=tuple(under_workdir(workdir, p) for p in m.get("editable") or ()) or (workdir,),
            must_pass=tuple(tests.get("must_pass") or ()),
            keep_passing=tuple(tests.get("keep_passing") or ()),
            junit=None if m.get("junit") is None else under_workdir(workdir, m["junit"]),
            allow=tuple(under_workdir(workdir, p) for p in m.get("allow") or ()),
        )

    def identity(self) -> dict[str, Any]:
        """What a grade depends on besides the env's lock and the hidden tree's digest (the
        task lock's grading spec; the hidden source's content is added when it is pinned)."""
        return {"env": self.env, "workdir": self.workdir, "hidden": self.hidden.identity(),
                "grade": self.grade.identity(), "editable": list(self.editable),
                "tests": {"must_pass": list(self.must_pass),
                          "keep_passing": list(self.keep_passing)},
                "junit": self.junit, "allow": list(self.allow)}


def under_workdir(workdir: str, path: str) -> str:
    """``path`` (absolute, or relative to ``workdir``) made absolute and normalised."""
    return posixpath.normpath(posixpath.join(workdir, path))


def is_under(path: str, directory: str) -> bool:
    """Whether normalised absolute ``path`` is ``directory`` or below it."""
    return path == directory or directory == "/" or path.startswith(directory + "/")


Definition = Base | Workspace | Toolkit | Env | Task
LayerDefinition = Base | Workspace | Toolkit

CONSTRUCTORS: Mapping[str, Callable[[Mapping[str, Any], Origin], Definition]] = {
    "Base": Base.from_mapping, "Workspace": Workspace.from_mapping,
    "Toolkit": Toolkit.from_mapping, "Env": Env.from_mapping, "Task": Task.from_mapping}


@dataclasses.dataclass(frozen=True)
class DefinitionSet:
    """Every definition loaded from one tree, by name. Names are unique across kinds."""

    root: str
    by_name: Mapping[str, Definition]

    def of_kind(self, kind: str) -> list[Definition]:
        return [d for d in self.by_name.values() if d.kind == kind]

    @property
    def layers(self) -> list[LayerDefinition]:
        return [d for d in self.by_name.values() if d.kind in LAYER_KINDS]  # type: ignore[misc]

    @property
    def envs(self) -> list[Env]:
        return [d for d in self.by_name.values() if isinstance(d, Env)]

    @property
    def tasks(self) -> list[Task]:
        return [d for d in self.by_name.values() if isinstance(d, Task)]
