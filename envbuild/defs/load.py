"""Load a definition tree: YAML files in, one validated ``DefinitionSet`` (or one error) out.

Contract of ``load_definitions(root)``:

- Reads every ``*.yaml`` / ``*.yml`` file below ``root``, recursively, in sorted order; other
  files (README.md, …) and hidden files or directories (``.git``, editor droppings) are ignored,
  and so is a subdirectory holding a ``.envbuild-tree`` file (a tree of its own, loaded only as
  a root: ``envdefs/examples/swe``).
  A file holds one or more documents separated by ``---``; empty documents are skipped.
- Every problem in every file is collected, then raised as one ``DefinitionError``: YAML syntax
  errors, empty files, documents that are not mappings, duplicate keys, unsupported tags, schema
  violations (see ``envbuild.defs.validate``) and names defined twice across the tree. Nothing is
  returned unless the whole tree is valid. References between definitions (``build_on``,
  ``toolkits``, …) are *not* checked here: that is the graph's job (``envbuild.plan.graph``).
- File names in problems and in ``Origin.file`` are relative to the current directory when the
  file is below it, else as reached from ``root``. Relative paths inside definitions
  (``source.path``, ``from.rootfs``, ``copy.src``, …) are kept as written; resolve them against
  ``Origin.directory``.
- ``Origin.field_positions`` maps every node's path (``build_on``, ``toolkits[1]``,
  ``steps[0].run``, ``from.debootstrap.suite``) to its 1-based (line, column).

Values are built from the composed YAML nodes by hand rather than by PyYAML's constructor, so
positions come for free and duplicate keys can be refused. Two deliberate departures from YAML
1.1, both because nobody writing a definition means them: mapping keys are always the key's text
(``on:`` is the string ``"on"``, not ``True``), and base-60 numbers stay text (``user: 0:0`` is
``"0:0"``, not ``0``). Timestamps stay text too.

Limits (``check_yaml_limits``, also used for job manifests): a file is at most
``MAX_YAML_BYTES``; a document at most ``MAX_YAML_NODES`` nodes *after* alias expansion and
``MAX_YAML_DEPTH`` levels deep, also counting what aliases bring in; an alias inside its own
anchor is refused. They are checked on the parser's events, before anything is composed or
expanded, so an alias bomb ("billion laughs": ten aliases of ten aliases of …, a few hundred
bytes that expand to 10^9 nodes) is one problem naming its line, found in microseconds.
Anchors and aliases themselves stay allowed: they are handy for a repeated value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from envbuild.defs.model import (
    CONSTRUCTORS,
    KINDS,
    Base,
    Definition,
    DefinitionSet,
    DockerfileSource,
    Origin,
)
from envbuild.defs.parsecache import ParseCache, git_blob_id
from envbuild.defs.validate import Positions, check_document
from envbuild.errors import DefinitionError, EnvbuildError, Problem

# libyaml's parser and composer are C: several times faster than the pure-Python ones, which
# matters for trees of 100,000 definitions. Without libyaml we are slower, not wrong.
Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

SUFFIXES = (".yaml", ".yml")

#: Bytes in one YAML/JSON file a user hands us (definitions, job manifests).
MAX_YAML_BYTES = 8 << 20
#: Nodes in one document after alias expansion: a definition has ~50, a large job manifest a
#: few thousand; building one node costs ~0.5 KB (value, position, path).
MAX_YAML_NODES = 100_000
#: Nesting levels of one document, aliases included (definitions nest ~5 levels).
MAX_YAML_DEPTH = 64

_STR = "tag:yaml.org,2002:str"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_MERGE = "tag:yaml.org,2002:merge"
_SAFE = yaml.constructor.SafeConstructor()  # its construct_yaml_* methods convert scalars


def _scalar_int(node: ScalarNode) -> Any:
    return node.value if ":" in node.value else _SAFE.construct_yaml_int(node)


def _scalar_float(node: ScalarNode) -> Any:
    return node.value if ":" in node.value else _SAFE.construct_yaml_float(node)


_SCALARS = {
    "tag:yaml.org,2002:int": _scalar_int,
    "tag:yaml.org,2002:float": _scalar_float,
    "tag:yaml.org,2002:bool": _SAFE.construct_yaml_bool,
    "tag:yaml.org,2002:null": lambda node: None,
    "tag:yaml.org,2002:timestamp": lambda node: node.value,
}


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """A tree as far as it parsed (``collect_definitions``): what a caller needs to run the
    graph checks over every valid document even when others have problems."""

    defs: DefinitionSet                # every document that validated (a duplicate: the first)
    problems: tuple[Problem, ...]      # every problem found in the files, sorted
    unparsed_names: frozenset[str]     # ``name:`` of documents that did not validate: the graph
    #                                    checks must not call references to them missing


def load_definitions(root: Path | str = Path("envdefs")) -> DefinitionSet:
    """Every definition under ``root``, validated; raises one ``DefinitionError`` listing all
    problems otherwise (see the module docstring for the contract)."""
    result = collect_definitions(root)
    if result.problems:
        raise DefinitionError(list(result.problems))
    return result.defs


def collect_definitions(root: Path | str = Path("envdefs"),
                        parse_cache: ParseCache | None = None) -> LoadResult:
    """Every definition under ``root`` that validates, with the problems of the others (the
    contract of ``load_definitions``, without raising for problems in files). Raises
    ``DefinitionError`` only when ``root`` is not a directory or holds no definition file.
    ``parse_cache``: files whose bytes it knows are not parsed again (``envbuild.defs.parsecache``)."""
    # Walk from the form of root we show, so every file name comes out in that form too.
    display_root = _display(Path(root))
    root = Path(display_root)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "no such directory"
        raise DefinitionError(Problem(
            display_root, 0, 0, f"definition directory: {what}",
            hint="pass the directory holding your definitions, or set --defs / ENVBUILD_DEFS"))
    files = _definition_file_names(root)
    if not files:
        raise DefinitionError(Problem(
            display_root, 0, 0, "no definitions found (no *.yaml or *.yml files)",
            hint="add definitions under base/, workspaces/, toolkits/ and envs/"))
    problems: list[Problem] = []
    unparsed: set[str] = set()
    loaded = [_load_file(path, path, problems, unparsed, parse_cache) for path in files]
    return assemble(display_root, loaded, problems, unparsed)


def assemble(display_root: str, loaded: list[list[Definition]], problems: list[Problem],
             unparsed: set[str]) -> LoadResult:
    """The ``LoadResult`` of files already loaded (their definitions in file order, the
    problems and unparsed names found so far): names defined twice become problems here."""
    by_name: dict[str, Definition] = {}
    for definitions in loaded:
        for definition in definitions:
            first = by_name.get(definition.name)
            if first is None:
                by_name[definition.name] = definition
                continue
            line, column = definition.origin.position("name")
            problems.append(Problem(
                definition.origin.file, line, column,
                f"duplicate name {definition.name!r}, first defined at "
                f"{first.origin.file}:{first.origin.position('name')[0]}",
                path="name", hint="names are unique across bases, workspaces, toolkits, envs and tasks"))
    for name, definition in by_name.items():
        if isinstance(definition, Base) and isinstance(definition.source, DockerfileSource):
            envs = _dockerfile_envs(definition, definition.source, display_root)
            if envs:
                by_name[name] = dataclasses.replace(
                    definition, source=dataclasses.replace(definition.source, envs=envs))
    return LoadResult(defs=DefinitionSet(root=display_root, by_name=MappingProxyType(by_name)),
                      problems=tuple(sorted(problems)),
                      unparsed_names=frozenset(unparsed - by_name.keys()))


def _dockerfile_envs(d: Base, src: DockerfileSource, root: str) -> tuple[str, ...]:
    """The in-tree envs a Dockerfile base's ``FROM envbuild.invalid/env/NAME`` lines name
    (``DockerfileSource.envs``). The Dockerfile is located as pinning does (inside the source
    root, no final symlink, bounded); one that cannot be located, read or parsed names none
    here: pinning reports why, at the definition's line."""
    from envbuild.defs.confine import Unpinnable, source_roots
    from envbuild.defs.dockerfile import env_upstreams, locate
    from envbuild.settings import trusted_sources

    try:
        roots = source_roots(root, trusted_sources(os.environ))
        _context, dockerfile = locate(src, str(d.origin.directory), roots)
        return env_upstreams(dockerfile, dict(src.args))
    except (Unpinnable, OSError, ValueError, EnvbuildError):
        return ()


#: A directory holding a file of this name is a definition tree of its own (an example such as
#: ``envdefs/examples/swe``): skipped when a parent tree is walked, loaded when it is the root.
SEPARATE_TREE_MARKER = ".envbuild-tree"


def definition_files(root: Path) -> list[Path]:
    """The YAML files under ``root`` in sorted order, skipping hidden files and directories and
    subdirectories that are trees of their own (``SEPARATE_TREE_MARKER``)."""
    return [Path(f) for f in _definition_file_names(root)]


def _definition_file_names(root: Path) -> list[str]:
    """``definition_files`` as strings (100,000 ``Path`` objects cost half a second)."""
    found: list[str] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")
                       and not os.path.exists(os.path.join(directory, d, SEPARATE_TREE_MARKER))]
        found.extend(os.path.join(directory, f) for f in filenames
                     if f.endswith(SUFFIXES) and not f.startswith("."))
    if str(root) == ".":  # as Path spells them: "a/b.yaml", not "./a/b.yaml"
        found = [f[2:] for f in found]
    return sorted(found)


def describe_counts(defs: DefinitionSet) -> str:
    """``"12 definitions (3 bases, 3 workspaces, 2 toolkits, 4 envs)"``, then ``", 1 task"``
    when the tree has tasks."""
    total = len(defs.by_name)
    parts = []
    for kind in KINDS:
        n = sum(1 for d in defs.by_name.values() if d.kind == kind)
        if kind == "Task" and not n:
            continue
        parts.append(f"{n} {kind.lower()}{'' if n == 1 else 's'}")
    return f"{total} definition{'' if total == 1 else 's'} ({', '.join(parts)})"


def _display(path: Path) -> str:
    if path.is_absolute():
        try:
            return str(path.relative_to(Path.cwd()))
        except ValueError:
            pass
    return str(path)


def _load_file(path: Path | str, file: str, problems: list[Problem],
               unparsed: set[str] | None = None,
               parse_cache: ParseCache | None = None) -> list[Definition]:
    digest = None
    try:
        if parse_cache is not None:
            # stat before reading: a change after the stat gives a newer stat next time
            st = os.stat(path)
            known = parse_cache.known_file(file, st)
            if known is not None:
                return known
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        problems.append(Problem(file, 0, 0, f"read file: {e.strerror or e}"))
        return []
    if parse_cache is not None:
        digest = hashlib.sha256(data).hexdigest()
        # REV's copy of it is not read again, nor is the file next time while its stat holds
        parse_cache.note_file(file, st, digest, git_blob_id(data))
        cached = parse_cache.get(digest, file)
        if cached is not None:
            return cached
    return load_bytes(data, file, problems, unparsed, parse_cache, digest)


def load_bytes(data: bytes, file: str, problems: list[Problem], unparsed: set[str] | None = None,
               parse_cache: ParseCache | None = None,
               digest: str | None = None) -> list[Definition]:
    """The definitions of one file's bytes, named ``file`` in origins and problems; problems
    are appended. With ``parse_cache`` and the bytes' ``digest``, a file without problems is
    cached (the caller looked it up already)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        problems.append(Problem(file, 0, 0, f"file is not utf-8 text: {e.reason} at byte {e.start}"))
        return []
    limit = check_yaml_limits(text, file)
    if limit is not None:
        problems.append(limit)
        return []
    definitions: list[Definition] = []
    documents = 0
    loader = Loader(text)
    try:
        while loader.check_node():
            node = loader.get_node()
            if isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null":
                continue  # an empty document, such as after a trailing '---'
            documents += 1
            definition = _load_document(node, file, problems, unparsed)
            if definition is not None:
                definitions.append(definition)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        message = f"invalid yaml: {e.problem or e.context}"
        if e.context and e.context_mark and e.problem:
            message += f" ({e.context} at line {e.context_mark.line + 1})"
        problems.append(Problem(file, mark.line + 1 if mark else 0, mark.column + 1 if mark else 0,
                                message, hint="check the indentation and quoting near this line"))
        return definitions
    except yaml.YAMLError as e:  # reader errors (control characters) carry no mark
        problems.append(Problem(file, 0, 0, f"invalid yaml: {e}"))
        return definitions
    finally:
        loader.dispose()
    if documents == 0:
        problems.append(Problem(file, 0, 0, "empty file: no definitions in it",
                                hint="add a definition, or delete the file"))
    elif parse_cache is not None and digest is not None and len(definitions) == documents:
        parse_cache.put(digest, definitions)  # every document valid: nothing to report again
    return definitions


def check_yaml_limits(text: str, file: str) -> Problem | None:  # noqa: C901, PLR0912  one event loop over libyaml's parser: a call per event type would run on every event of every definition load
    """The first limit ``text`` breaks (see the module docstring), as a problem at its line;
    None if it keeps them all. Reads only parser events: nothing is composed or expanded, and
    the cost is one pass of libyaml's parser. Syntax errors are left to the loader (None)."""
    if len(text) > MAX_YAML_BYTES:
        return Problem(file, 0, 0, f"file is {len(text)} characters, over the "
                       f"{MAX_YAML_BYTES >> 20} MiB limit for a YAML/JSON document",
                       hint="split it into several files")
    _open = None  # marks an anchor whose collection is still being parsed
    sizes: dict[str, tuple[int, int] | None] = {}  # anchor -> (nodes, height) of its value
    stack: list[list] = []  # open collections: [anchor, nodes before it, tallest child]
    nodes = 0
    loader = Loader(text)
    try:
        while loader.check_event():
            event = loader.get_event()
            cls = event.__class__
            if cls is ScalarEvent or cls is AliasEvent:
                n, height = 1, 0
                if cls is AliasEvent:
                    got = sizes.get(event.anchor, (1, 0))  # undefined: the composer says so
                    if got is _open:
                        return _limit(file, event, f"alias *{event.anchor} is inside its own "
                                      "anchor (a recursive structure)",
                                      "an alias can only repeat a value that is complete")
                    n, height = got
                elif event.anchor is not None:
                    sizes[event.anchor] = (1, 0)
                nodes += n
                if stack:
                    top = stack[-1]
                    top[2] = max(top[2], height)
                if nodes > MAX_YAML_NODES or len(stack) + height > MAX_YAML_DEPTH:
                    return _too_big(file, event, nodes, len(stack) + height)
            elif cls is SequenceStartEvent or cls is MappingStartEvent:
                nodes += 1
                stack.append([event.anchor, nodes - 1, 0])
                if event.anchor is not None:
                    sizes[event.anchor] = _open
                if nodes > MAX_YAML_NODES or len(stack) > MAX_YAML_DEPTH:
                    return _too_big(file, event, nodes, len(stack))
            elif cls is SequenceEndEvent or cls is MappingEndEvent:
                anchor, before, tallest = stack.pop()
                if anchor is not None:
                    sizes[anchor] = (nodes - before, tallest + 1)
                if stack:
                    stack[-1][2] = max(stack[-1][2], tallest + 1)
            elif cls is DocumentStartEvent:
                sizes.clear()  # anchors are per document
                nodes = 0
    except yaml.YAMLError:
        return None
    finally:
        loader.dispose()
    return None


def _too_big(file: str, event, nodes: int, depth: int) -> Problem:
    alias = event.__class__ is AliasEvent
    if depth > MAX_YAML_DEPTH:
        what = f"nesting deeper than {MAX_YAML_DEPTH} levels"
        return _limit(file, event, f"alias *{event.anchor} makes {what}" if alias
                      else f"document has {what}", "flatten the document")
    if alias:
        return _limit(file, event, f"alias *{event.anchor} makes the document larger than "
                      f"{MAX_YAML_NODES} nodes (an alias bomb?)",
                      "aliases may repeat small values; write big repeated parts out")
    return _limit(file, event, f"document has more than {MAX_YAML_NODES} nodes",
                  "split it into several documents or files")


def _limit(file: str, event, message: str, hint: str) -> Problem:
    mark = event.start_mark
    return Problem(file, mark.line + 1, mark.column + 1, message, hint=hint)


def _load_document(node: Node, file: str, problems: list[Problem],
                   unparsed: set[str] | None = None) -> Definition | None:
    line, column = node.start_mark.line + 1, node.start_mark.column + 1
    if not isinstance(node, MappingNode):
        got = "a list" if isinstance(node, SequenceNode) else f"{node.value!r}"
        problems.append(Problem(file, line, column, f"a definition must be a mapping, got {got}",
                                hint="start the document with 'apiVersion: envbuild/v1'"))
        return None
    builder = NodeBuilder(file)
    doc = builder.value(node, "")
    doc_problems = check_document(doc, file, builder.positions, lambda: node_key_positions(node))
    if builder.problems:
        # A node the builder refused (an unsupported tag, say) reaches the schema as None; its
        # "expected a string, got nothing" would only repeat the builder's problem.
        refused = {p.path for p in builder.problems}
        doc_problems = builder.problems + [p for p in doc_problems if p.path not in refused]
    if doc_problems:
        problems.extend(doc_problems)
        if unparsed is not None and isinstance(doc, dict) and isinstance(doc.get("name"), str):
            unparsed.add(doc["name"])
        return None
    origin = Origin(file=file, line=line, column=column,
                    field_positions=MappingProxyType(builder.positions))
    return CONSTRUCTORS[doc["kind"]](doc, origin)


class NodeBuilder:
    """Plain Python values from composed nodes, recording the position of every node.

    Public because job manifests are read with it too (``envbuild.jobs.load``).
    This is the per-node hot path of loading: keep it to a dict store and a type dispatch.
    """

    __slots__ = ("file", "positions", "problems")

    def __init__(self, file: str) -> None:
        self.file = file
        self.positions: dict[str, tuple[int, int]] = {}
        self.problems: list[Problem] = []

    def value(self, node: Node, path: str) -> Any:
        mark = node.start_mark
        self.positions[path] = (mark.line + 1, mark.column + 1)
        cls = node.__class__
        if cls is ScalarNode:
            if node.tag == _STR:
                return node.value
            convert = _SCALARS.get(node.tag)
            if convert is None:
                return self._unsupported(node, path)
            return convert(node)
        if cls is MappingNode:
            if node.tag != _MAP:
                return self._unsupported(node, path)
            result: dict[str, Any] = {}
            prefix = path + "." if path else ""
            for key_node, value_node in node.value:
                if key_node.__class__ is not ScalarNode:
                    self._problem(key_node, path, "a key must be a plain string, not a "
                                  + ("list" if isinstance(key_node, SequenceNode) else "mapping"))
                    continue
                key = key_node.value
                if key_node.tag == _MERGE:
                    self._problem(key_node, path, "merge keys ('<<') are not supported",
                                  "repeat the keys; an anchor (&x / *x) may stand for a whole value")
                    continue
                if key in result:
                    first = self.positions[prefix + key][0]
                    self._problem(key_node, prefix + key, f"duplicate key {key!r}",
                                  f"it is already set on line {first}")
                    continue
                result[key] = self.value(value_node, prefix + key)
            return result
        if node.tag != _SEQ:
            return self._unsupported(node, path)
        return [self.value(item, f"{path}[{i}]") for i, item in enumerate(node.value)]

    def _problem(self, node: Node, path: str, message: str, hint: str | None = None) -> None:
        mark = node.start_mark
        self.problems.append(Problem(self.file, mark.line + 1, mark.column + 1, message,
                                     path=path, hint=hint))

    def _unsupported(self, node: Node, path: str) -> None:
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        self._problem(node, path, f"unsupported yaml tag {tag!r}",
                      "remove the tag; definitions use plain strings, numbers, lists and mappings")
        return None


def node_key_positions(root: MappingNode) -> Positions:
    """Path of every mapping entry -> position of its key; only needed to report problems.
    Shared with ``envbuild.jobs.load``."""
    positions: dict[str, tuple[int, int]] = {}
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode):
                    child = f"{path}.{key_node.value}" if path else key_node.value
                    mark = key_node.start_mark
                    positions.setdefault(child, (mark.line + 1, mark.column + 1))
                    stack.append((value_node, child))
        elif isinstance(node, SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
    return positions
