"""Check one parsed definition document against the JSON Schemas and explain what is wrong.

The schemas (``schema/*.json``, package data) are the contract for what a valid document is:
one file per kind plus ``common.json`` with the shared pieces (steps, config, sources). They are
compiled once per process, one ``Draft202012Validator`` per kind.

``check_document`` returns ``Problem``s, never raises for a bad document:

- the header (``apiVersion``, ``kind``) is checked by hand first, because the kind picks the
  schema and an unknown kind deserves a "did you mean" rather than six schema failures;
- a document that passes ``is_valid`` costs nothing more (the common case, kept fast for trees of
  100,000 definitions); only failing documents pay for ``iter_errors`` and the error mapping;
- each jsonschema error becomes one problem at the line and column of the offending node: the
  key itself for an unknown key, the mapping for a missing key, the value otherwise. ``oneOf``
  failures are collapsed: the branch the document evidently meant (by type, then by its
  required key) reports its own errors, else one message says what the alternatives are.

Schema annotations drive the wording: a ``title`` names the thing ("is not a valid name"), a
``description`` next to a ``pattern`` says in words what the pattern allows and becomes the hint.
"""

from __future__ import annotations

import functools
import json
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource

from envbuild.defs.hints import suggest
from envbuild.defs.model import API_VERSION, KINDS, is_under, under_workdir
from envbuild.errors import Problem

if TYPE_CHECKING:
    from referencing._core import Resolver

Position = tuple[int, int]
Positions = Mapping[str, Position]

SCHEMA_FILES = {"Base": "base.json", "Workspace": "workspace.json",
                "Toolkit": "toolkit.json", "Env": "env.json", "Task": "task.json"}
_COMMON = "common.json"
_HEADER_KEYS = ("apiVersion", "kind")

_TYPE_NOUNS = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "true or false", "object": "a mapping", "array": "a list",
               "null": "nothing"}
_TYPE_PLURALS = {"string": "strings", "integer": "integers", "number": "numbers",
                 "boolean": "booleans", "object": "mappings", "array": "lists"}
_PY_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def load_schema(kind_or_file: str) -> dict[str, Any]:
    """The parsed JSON Schema for a kind (``"Toolkit"``) or a file name (``"common.json"``)."""
    name = SCHEMA_FILES.get(kind_or_file, kind_or_file)
    text = resources.files("envbuild.defs").joinpath("schema", name).read_text(encoding="utf-8")
    return json.loads(text)


@functools.cache
def validators() -> dict[str, Draft202012Validator]:
    """The compiled validator of each kind, built once per process.

    The files use ``$ref`` into common.json; the validators get the schemas with every ``$ref``
    inlined (they are not recursive). Resolving references through ``referencing`` on every
    document was half the cost of validating one, and the error wording wants the resolved
    subschemas anyway.
    """
    common = load_schema(_COMMON)
    kinds = {kind: load_schema(kind) for kind in KINDS}
    registry: Registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in (common, *kinds.values())
    )
    return {kind: Draft202012Validator(inline_refs(schema, registry.resolver(schema["$id"])))
            for kind, schema in kinds.items()}


def inline_refs(schema: Any, resolver: Resolver) -> Any:
    """``schema`` with every ``$ref`` replaced by what it names (definitions and job manifests
    compile their validators this way)."""
    if isinstance(schema, list):
        return [inline_refs(s, resolver) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        resolved = resolver.lookup(schema["$ref"])
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        return {**inline_refs(resolved.contents, resolved.resolver),
                **inline_refs(siblings, resolver)}
    # $defs are only reached through the $refs just inlined; a copy here would be dead weight.
    return {k: inline_refs(v, resolver) for k, v in schema.items() if k != "$defs"}


def check_document(
    doc: Mapping[str, Any],
    file: str,
    positions: Positions,
    key_positions: Callable[[], Positions],
) -> list[Problem]:
    """Every problem in one document (a mapping); empty when it is a valid definition.

    ``positions`` maps a document path (``""``, ``"steps[0].run"``) to the 1-based line and
    column of its value; ``key_positions`` is called only for a failing document and maps the
    path of a mapping entry to the position of its key.
    """
    problems = _check_header(doc, file, positions)
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMA_FILES:
        return problems
    validator = validators()[kind]
    if not problems and validator.is_valid(doc):
        return check_task_paths(doc, file, positions) if kind == "Task" else problems
    mapper = SchemaErrorMapper(kind, file, positions, key_positions())
    found = set(problems)
    for error in validator.iter_errors(doc):
        found.update(mapper.problems(error))
    return sorted(found)


def check_task_paths(doc: Mapping[str, Any], file: str, positions: Positions) -> list[Problem]:
    """What a Task's schema cannot say: every ``editable`` and ``allow`` path is under
    ``workdir``; the ``junit`` report is not where the agent may write (it could forge one);
    ``tests`` need a ``junit`` report to be read from."""
    workdir = posixpath.normpath(doc["workdir"])
    problems = []

    def problem(path: str, message: str, hint: str) -> None:
        where = positions.get(path) or positions.get("", (0, 0))
        problems.append(Problem(file, *where, message, path=path, hint=hint))

    editable = []
    for i, p in enumerate(doc.get("editable") or ()):
        full = under_workdir(workdir, p)
        editable.append(full)
        if not is_under(full, workdir):
            problem(f"editable[{i}]", f"editable: {p!r} is outside workdir {workdir!r}",
                    f"the agent's work is read from workdir: name a path under {workdir}")
    for i, p in enumerate(doc.get("allow") or ()):
        if not is_under(under_workdir(workdir, p), workdir):
            problem(f"allow[{i}]", f"allow: {p!r} is outside workdir {workdir!r}",
                    f"allow names test-settings files of the agent's work: under {workdir}")
    junit = doc.get("junit")
    if junit is not None:
        full = under_workdir(workdir, junit)
        if any(is_under(full, e) for e in editable or [workdir]):
            problem("junit", f"junit: {junit!r} is a path the agent may change, so it could "
                    "forge the report", "write it outside the editable paths, e.g. /tmp/junit.xml")
    if doc.get("tests") and junit is None:
        problem("tests", "tests names test ids, but no junit report to read their results from",
                "add junit: PATH and make grade.run write JUnit XML there (pytest --junitxml)")
    return problems


def _check_header(doc: Mapping[str, Any], file: str, positions: Positions) -> list[Problem]:
    problems = []
    where = positions.get("", (0, 0))
    api = doc.get("apiVersion")
    if "apiVersion" not in doc:
        problems.append(Problem(file, *where, "missing apiVersion",
                                hint=f"use apiVersion: {API_VERSION}"))
    elif api != API_VERSION:
        problems.append(Problem(file, *positions["apiVersion"],
                                f"unsupported apiVersion {api!r}", path="apiVersion",
                                hint=f"use apiVersion: {API_VERSION}"))
    kind = doc.get("kind")
    if "kind" not in doc:
        problems.append(Problem(file, *where, "missing kind",
                                hint=f"kind is one of {', '.join(KINDS)}"))
    elif not isinstance(kind, str) or kind not in SCHEMA_FILES:
        hint = suggest(kind, KINDS) if isinstance(kind, str) else None
        problems.append(Problem(file, *positions["kind"], f"unknown kind {kind!r}", path="kind",
                                hint=hint or f"kind is one of {', '.join(KINDS)}"))
    return problems


def _path(parts: Iterable[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _field(path: str) -> str:
    """The name a message uses for the node at ``path``: its own key, with any indices."""
    return path.rsplit(".", 1)[-1] if path else "the definition"


def _got(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    for name, test in _PY_TYPES.items():
        if test(value):
            return _TYPE_NOUNS[name]
    return type(value).__name__


def _quoted(values: Iterable[Any]) -> str:
    return ", ".join(repr(v) for v in values)


class SchemaErrorMapper:
    """Turns the jsonschema errors of one document into problems at their lines (definitions
    and job manifests, ``envbuild.jobs.load``, word them alike)."""

    def __init__(self, kind: str, file: str, positions: Positions,
                 key_positions: Positions) -> None:
        self.kind = kind
        self.file = file
        self.positions = positions
        self.key_positions = key_positions

    def problem(self, path: str, message: str, hint: str | None = None, *,
                at_key: bool = False) -> Problem:
        where = self.key_positions.get(path) if at_key else None
        if where is None:
            where = self.positions.get(path) or self.positions.get("", (0, 0))
        return Problem(self.file, where[0], where[1], message, path=path, hint=hint)

    def problems(self, error: ValidationError) -> Iterator[Problem]:
        path = _path(error.absolute_path)
        kw = error.validator
        schema = error.schema if isinstance(error.schema, dict) else {}
        if path in _HEADER_KEYS:
            return  # reported by _check_header with a better message
        if kw == "additionalProperties":
            yield from self._unknown_keys(path, error.instance, schema)
        elif kw == "required":
            # One error per missing key, each carrying the whole list: report them all here and
            # let the caller's set drop the repeats.
            for key in error.validator_value:
                if key not in error.instance and not (path == "" and key in _HEADER_KEYS):
                    yield self._missing_key(path, key, schema)
        elif kw in ("oneOf", "anyOf"):
            yield from self._alternatives(path, error)
        elif kw == "type":
            yield self._wrong_type(path, error.instance, schema)
        elif kw in ("enum", "const"):
            allowed = schema["enum"] if kw == "enum" else [schema["const"]]
            hint = suggest(error.instance, map(str, allowed)) if isinstance(error.instance, str) else None
            hint = hint or schema.get("description")  # why only these (a rule between keys)
            yield self.problem(path, f"{_field(path)}: expected one of {_quoted(allowed)}, "
                                     f"got {error.instance!r}", hint)
        elif kw == "pattern":
            yield self._bad_pattern(path, error, schema)
        elif kw in ("minProperties", "maxProperties") and schema.get("minProperties") == 1 \
                and schema.get("maxProperties") == 1:
            keys = _quoted(schema.get("properties", {}))
            yield self.problem(path, f"{_field(path)} needs exactly one of {keys}",
                               f"got {len(error.instance)} keys" if error.instance else None)
        elif kw == "uniqueItems":
            dupes = sorted({repr(v) for v in error.instance if error.instance.count(v) > 1})
            yield self.problem(path, f"{_field(path)}: duplicate item {', '.join(dupes)}",
                               "list each item once")
        elif kw == "minLength" and error.validator_value == 1:
            yield self.problem(path, f"{_field(path)}: must not be empty")
        elif kw == "exclusiveMinimum":
            yield self.problem(path, f"{_field(path)}: must be more than "
                                     f"{error.validator_value}, got {error.instance!r}")
        elif kw == "minItems" and error.validator_value == 1:
            yield self.problem(path, f"{_field(path)}: must list at least one item")
        else:
            yield self.problem(path, f"{_field(path)}: {error.message}")

    def _unknown_keys(self, path: str, instance: dict, schema: dict) -> Iterator[Problem]:
        allowed = list(schema.get("properties", {}))
        for key in instance:
            if key in allowed:
                continue
            if not allowed:
                hint = f"{_field(path)} takes no keys"
            else:
                hint = suggest(key, allowed) or f"allowed here: {', '.join(allowed)}"
            yield self.problem(_child(path, key), f"unknown key {key!r}", hint, at_key=True)

    def _missing_key(self, path: str, key: str, schema: dict) -> Problem:
        required = schema.get("required", [])
        if path == "":
            needs = [k for k in required if k not in _HEADER_KEYS]
            hint = f"a {self.kind} needs {', '.join(needs)}"
        else:
            hint = f"{_field(path)} needs {', '.join(required)}"
        return self.problem(path, f"missing required key {key!r}", hint)

    def _wrong_type(self, path: str, value: Any, schema: dict) -> Problem:
        expected = self._expected(schema)
        hint = None
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types or []
        if isinstance(value, (bool, int, float)) and "string" in types:
            hint = "put the value in quotes to make it a string"
        elif value is None:
            hint = "give it a value, or remove the key"
        elif types == ["array"] and isinstance(value, (str, int, float)):
            hint = f"write a list: {_field(path)}: [{value}]"
        return self.problem(path, f"{_field(path)}: expected {expected}, got {_got(value)}", hint)

    def _bad_pattern(self, path: str, error: ValidationError, schema: dict) -> Problem:
        noun = schema.get("title", "value")
        hint = schema.get("description")
        if "propertyNames" in error.absolute_schema_path:
            # The offending thing is a key of the mapping at ``path``: point at the key.
            key_path = _child(path, error.instance)
            return self.problem(key_path, f"{error.instance!r} is not a valid {noun}", hint,
                                at_key=True)
        return self.problem(path, f"{_field(path)}: {error.instance!r} is not a valid {noun}",
                            hint)

    def _alternatives(self, path: str, error: ValidationError) -> Iterator[Problem]:
        schema = error.schema
        branches = schema[error.validator]
        value = error.instance
        fits = [i for i, b in enumerate(branches) if _type_fits(b, value)]
        if len(fits) > 1 and isinstance(value, dict):
            fits = [i for i in fits if all(k in value for k in branches[i].get("required", ()))]
        if len(fits) == 1:
            sub = [e for e in error.context if e.relative_schema_path[0] == fits[0]]
            for e in sub:
                yield from self.problems(e)
            if sub:
                return
        if not any(_type_fits(b, value) for b in branches):
            expected = " or ".join(dict.fromkeys(self._expected(b) for b in branches))
            yield self.problem(path, f"{_field(path)}: expected {expected}, got {_got(value)}")
            return
        # Several object branches told apart by a required key, and the value has none or many.
        keys = [b["required"][0] for b in branches if b.get("required")]
        noun = schema.get("title", _field(path))
        hint = None
        if isinstance(value, dict):
            known = {k for b in branches for k in b.get("properties", {})}
            hint = next(filter(None, (suggest(k, keys) for k in value if k not in known)), None)
        yield self.problem(path, f"a {noun} needs exactly one of {' or '.join(map(repr, keys))}",
                           hint)

    def _expected(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "a value"
        if "oneOf" in schema or "anyOf" in schema:
            if "title" in schema:
                return f"a {schema['title']}"
            branches = schema.get("oneOf") or schema.get("anyOf") or []
            return " or ".join(dict.fromkeys(self._expected(b) for b in branches))
        types = schema.get("type", [])
        types = [types] if isinstance(types, str) else types
        nouns = []
        for t in types:
            if t == "array" and "items" in schema:
                nouns.append(f"a list of {self._plural(schema['items'])}")
            else:
                nouns.append(_TYPE_NOUNS.get(t, t))
        return " or ".join(nouns) or "a value"

    def _plural(self, schema: Any) -> str:
        if "title" in schema:
            return f"{schema['title']}s"
        t = schema.get("type")
        return _TYPE_PLURALS.get(t, "values") if isinstance(t, str) else "values"


def _type_fits(schema: Mapping[str, Any], value: Any) -> bool:
    types = schema.get("type")
    if types is None:
        return True
    types = [types] if isinstance(types, str) else types
    return any(_PY_TYPES[t](value) for t in types)
