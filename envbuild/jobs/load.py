"""Loading and writing job manifest files (YAML or JSON) against the JobManifest schema.

``load_job_manifest(path) -> JobManifest`` reads one document with the definition loader's
position-tracking YAML builder (``envbuild.defs.load``: JSON is YAML, so both formats get
positions), checks it against ``envbuild/defs/schema/jobmanifest.json`` with the definition
validator's error wording (``envbuild.defs.validate``), checks what a schema cannot (group
names unique), and raises one ``JobManifestError`` listing every problem as
``FILE:LINE:COL: message (at path) — hint``. ``write_job_manifest`` writes a manifest
atomically (temp file, fsync, rename), YAML unless the name ends in ``.json``.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from envbuild.atomic import write_atomic
from envbuild.defs.load import Loader, NodeBuilder, check_yaml_limits, node_key_positions
from envbuild.defs.validate import Positions, SchemaErrorMapper, inline_refs, load_schema
from envbuild.errors import DefinitionError, EnvbuildError, Problem
from envbuild.jobs.model import API_VERSION, KIND, OLD_LIMIT_NAMES, SIZE_LIMITS, JobManifest
from envbuild.sizes import SizeError, parse_size

SCHEMA_FILE = "jobmanifest.json"


class JobManifestError(DefinitionError):
    """Problems in a job manifest file, all collected (a ``DefinitionError``: same one line per
    problem rendering, ``reference`` ``job-manifest-error``)."""

    reference = "job-manifest-error"

    def __init__(self, problems: list[Problem] | Problem, *, hint: str | None = None) -> None:
        super().__init__(problems, hint=hint)
        count = len(self.problems)
        self.message = f"{count} problem{'s' if count != 1 else ''} in job manifest"
        self.args = (self.message,)


@functools.cache
def validator() -> Draft202012Validator:
    """The compiled JobManifest validator, ``$ref``s inlined like the definition validators."""
    common, schema = load_schema("common.json"), load_schema(SCHEMA_FILE)
    registry: Registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in (common, schema))
    return Draft202012Validator(inline_refs(schema, registry.resolver(schema["$id"])))


def check_job_document(doc: dict[str, Any], file: str, positions: Positions,
                       key_positions: Callable[[], Positions]) -> list[Problem]:
    """Every problem of a parsed job manifest document; empty when it is valid."""
    where = positions.get("", (0, 0))
    problems = []
    if doc.get("apiVersion") != API_VERSION:
        at = positions.get("apiVersion", where)
        problems.append(Problem(file, *at, f"unsupported apiVersion {doc.get('apiVersion')!r}"
                                if "apiVersion" in doc else "missing apiVersion",
                                path="apiVersion" if "apiVersion" in doc else "",
                                hint=f"use apiVersion: {API_VERSION}"))
    if doc.get("kind") != KIND:
        at = positions.get("kind", where)
        problems.append(Problem(file, *at, f"not a job manifest: kind {doc.get('kind')!r}"
                                if "kind" in doc else "missing kind",
                                path="kind" if "kind" in doc else "", hint=f"use kind: {KIND}"))
    problems += _duplicate_names(doc, file, positions)
    problems += _runtime_values(doc, file, positions)
    v = validator()
    if not problems and v.is_valid(doc):
        return problems
    mapper = SchemaErrorMapper(KIND, file, positions, key_positions())
    found = set(problems)
    for error in v.iter_errors(doc):
        if list(error.absolute_path)[:1] in (["apiVersion"], ["kind"]):
            continue  # reported above with a better message
        found.update(mapper.problems(error))
    return sorted(found)


def _runtime_values(doc: dict[str, Any], file: str, positions: Positions) -> list[Problem]:
    """What the schema leaves to the runtime's one copy: a backend registered with
    ``runtime_shim.backends``, sizes in ``envbuild.sizes``' grammar, ``memory`` (the old name)
    and ``memory_bytes`` not both."""
    from runtime_shim.backends import backend_names

    problems = []
    groups = doc.get("groups")
    for i, group in enumerate(groups if isinstance(groups, list) else []):
        if not isinstance(group, dict):
            continue
        at = f"groups[{i}]"
        backend = group.get("backend")
        if isinstance(backend, str) and backend not in backend_names():
            close = difflib.get_close_matches(backend, backend_names(), n=1)
            problems.append(Problem(
                file, *positions.get(f"{at}.backend", (0, 0)),
                f"backend: unknown sandbox backend {backend!r}", path=f"{at}.backend",
                hint=f"did you mean {close[0]!r}?" if close
                else f"choose one of: {', '.join(backend_names())}"))
        limits = group.get("limits")
        problems += _limit_values(limits if isinstance(limits, dict) else {}, f"{at}.limits",
                                  file, positions)
    return problems


def _limit_values(limits: dict[str, Any], at: str, file: str,
                  positions: Positions) -> list[Problem]:
    problems = []
    for key in sorted(SIZE_LIMITS | set(OLD_LIMIT_NAMES)):
        value = limits.get(key)
        if not isinstance(value, str):
            continue  # an int is bytes; other types are the schema's to report
        try:
            parse_size(value)
        except SizeError as e:
            problems.append(Problem(file, *positions.get(f"{at}.{key}", (0, 0)),
                                    f"{key}: {value!r} is not a size", path=f"{at}.{key}",
                                    hint=e.hint))
    for old, new in OLD_LIMIT_NAMES.items():
        if old in limits and new in limits:
            problems.append(Problem(file, *positions.get(f"{at}.{old}", (0, 0)),
                                    f"{old} and {new} are one limit", path=f"{at}.{old}",
                                    hint=f"keep {new} (the SDK's name)"))
    return problems


def _duplicate_names(doc: dict[str, Any], file: str, positions: Positions) -> list[Problem]:
    problems: list[Problem] = []
    first: dict[str, int] = {}
    groups = doc.get("groups")
    for i, group in enumerate(groups if isinstance(groups, list) else []):
        name = group.get("name") if isinstance(group, dict) else None
        if not isinstance(name, str):
            continue
        if name in first:
            problems.append(Problem(file, *positions.get(f"groups[{i}].name", (0, 0)),
                                    f"duplicate group name {name!r}", path=f"groups[{i}].name",
                                    hint=f"it is already used on line {first[name]}"))
        else:
            first[name] = positions.get(f"groups[{i}].name", (0, 0))[0]
    return problems


def load_job_manifest(path: str | os.PathLike[str]) -> JobManifest:
    """The manifest in ``path`` (YAML or JSON), valid, or one ``JobManifestError``."""
    file = os.fspath(path)
    try:
        text = Path(file).read_bytes().decode("utf-8")
    except OSError as e:
        raise JobManifestError(Problem(file, 0, 0, f"read job manifest: {e.strerror or e}")) from e
    except UnicodeDecodeError as e:
        raise JobManifestError(Problem(file, 0, 0, f"file is not utf-8 text: {e.reason}")) from e
    return parse_job_manifest(text, file)


def parse_job_manifest(text: str, file: str = "<manifest>") -> JobManifest:
    """``load_job_manifest`` for text already read; ``file`` names it in problems."""
    limit = check_yaml_limits(text, file)  # size, depth, alias bombs: before composing
    if limit is not None:
        raise JobManifestError(limit)
    loader = Loader(text)
    nodes = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if not (isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"):
                nodes.append(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise JobManifestError(Problem(
            file, mark.line + 1 if mark else 0, mark.column + 1 if mark else 0,
            f"invalid yaml: {e.problem or e.context}",
            hint="check the indentation and quoting near this line")) from None
    except yaml.YAMLError as e:
        raise JobManifestError(Problem(file, 0, 0, f"invalid yaml: {e}")) from None
    finally:
        loader.dispose()
    if len(nodes) != 1:
        at: tuple[int, int] = (nodes[1].start_mark.line + 1, 1) if nodes else (0, 0)
        raise JobManifestError(Problem(
            file, *at, "empty file: no job manifest in it" if not nodes
            else "a job manifest file holds one document", hint="remove the other documents"
            if nodes else f"start with 'apiVersion: {API_VERSION}' and 'kind: {KIND}'"))
    node = nodes[0]
    if not isinstance(node, MappingNode):
        got = "a list" if isinstance(node, SequenceNode) else repr(getattr(node, "value", node))
        raise JobManifestError(Problem(file, node.start_mark.line + 1, node.start_mark.column + 1,
                                       f"a job manifest must be a mapping, got {got}",
                                       hint=f"start with 'apiVersion: {API_VERSION}'"))
    builder = NodeBuilder(file)
    doc = builder.value(node, "")
    problems = check_job_document(doc, file, builder.positions, lambda: node_key_positions(node))
    if builder.problems:
        refused = {p.path for p in builder.problems}
        problems = builder.problems + [p for p in problems if p.path not in refused]
    if problems:
        raise JobManifestError(problems)
    return JobManifest.from_mapping(doc)


def render_job_manifest(manifest: JobManifest, *, as_json: bool = False) -> str:
    """The text of a manifest: deterministic, so resolving a resolved file changes no byte."""
    doc = manifest.to_mapping()
    if as_json:
        return json.dumps(doc, indent=2) + "\n"
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=4096,
                          allow_unicode=True)


def write_job_manifest(manifest: JobManifest, dest: str | os.PathLike[str] | None) -> None:
    """Write ``manifest`` to ``dest`` atomically (JSON if it ends in ``.json``), or to stdout
    when ``dest`` is ``None`` or ``"-"``."""
    if dest is None or os.fspath(dest) == "-":
        sys.stdout.write(render_job_manifest(manifest))
        return
    dest = Path(dest)
    data = render_job_manifest(manifest, as_json=dest.suffix == ".json").encode()
    try:
        write_atomic(dest, data, fsync=True)
    except OSError as e:
        raise EnvbuildError(f"write job manifest {dest}: {e.strerror or e}",
                            hint="the directory must exist and be writable") from e


def default_output(path: str | os.PathLike[str]) -> Path:
    """Where ``envbuild job resolve FILE`` writes by default: ``jobs.yaml`` →
    ``jobs.resolved.yaml`` (same suffix); a ``*.resolved.*`` file is rewritten in place."""
    path = Path(path)
    suffix = path.suffix if path.suffix in (".yaml", ".yml", ".json") else ".yaml"
    stem = path.name[: -len(path.suffix)] if path.suffix == suffix else path.name
    if stem.endswith(".resolved"):
        return path
    return path.with_name(f"{stem}.resolved{suffix}")
