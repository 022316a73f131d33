"""The definition graph: which definition is built on, stacked on, or composed of which.

Nodes are definition names; an edge ``u -> v`` means "v needs u" (u is built first):

- ``Base.parent`` (``from: {base: X}``):       X -> base
- a Dockerfile base's ``FROM envbuild.invalid/env/E`` (``DockerfileSource.envs``): E -> base
- ``Workspace/Toolkit.build_on``:               base -> layer
- ``Env.base``, ``Env.workspace``, ``Env.toolkits``: each -> env
- ``Task.env``:                                  env -> task (its ``hidden`` source is pinned,
  not a definition: no node)

``build_graph`` checks everything that needs more than one document to see, collects *all*
problems and raises one ``PlanError``:

- a missing reference (with a "did you mean" over names of the right kind) or a reference to the
  wrong kind (``build_on`` naming a Toolkit), reported at the line of the referring field;
- a cycle of ``from: {base: ...}`` (printed ``a -> b -> a``, in reference order);
- an ABI mismatch: a Workspace/Toolkit whose ``requires.abi`` (empty = "the abi of my build_on
  base") does not admit the abi of its ``build_on`` base, or of the base of an Env that uses it;
- two toolkits of one Env whose prefixes overlap (equal, or one under the other).

Pure: no disk, no processes. ``EnvGraph`` is read-only after construction. The edges are kept
as plain dicts (each node's dependencies) and the checks and orders run over them; a networkx
``DiGraph`` is built only when asked for (``EnvGraph.graph``) or to print a cycle: building one
of 100,000 nodes costs more than every check together.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from envbuild.defs.hints import suggest
from envbuild.defs.model import (
    Base,
    Definition,
    DefinitionSet,
    Env,
    LayerDefinition,
    Origin,
    Task,
    Toolkit,
    Workspace,
)
from envbuild.errors import DefinitionError, PlanError, Problem

if TYPE_CHECKING:
    import networkx as nx

    from envbuild.defs.load import LoadResult
    from envbuild.defs.parsecache import ParseCache


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """``did you mean 'x'?`` for the closest candidate, or None (the loader's hint, so every
    hint reads the same)."""
    return suggest(name, candidates)


def field_position(origin: Origin, *paths: str) -> tuple[int, int]:
    """Line/column of the first of ``paths`` the loader recorded, else of the document."""
    for p in paths:
        if p in origin.field_positions:
            return origin.field_positions[p]
    return origin.line, origin.column


def _problem(d: Definition, paths: Sequence[str], message: str, hint: str | None = None) -> Problem:
    line, column = field_position(d.origin, *paths)
    return Problem(d.origin.file, line, column, message, path=paths[0], hint=hint)


def _prefix_overlap(a: str, b: str) -> bool:
    a, b = posixpath.normpath(a), posixpath.normpath(b)
    if a == b or a == "/" or b == "/":
        return True
    return b.startswith(a + "/") or a.startswith(b + "/")


@dataclasses.dataclass(frozen=True, eq=False)
class EnvGraph:
    """A checked DAG of definitions. Build it with ``build_graph``.

    ``preds`` maps every definition name to the names it depends on (each once, in reference
    order): the edges, from dependency to dependent. ``graph`` is the same as a networkx
    ``DiGraph``, built on first use; treat both as read-only. Orders returned here are
    deterministic (names sorted within a generation).
    """

    defs: DefinitionSet
    preds: dict[str, list[str]]
    _chains: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, repr=False)
    _memo: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> Definition:
        return self.defs.by_name[name]

    def layer(self, name: str) -> LayerDefinition:
        """Layer definition ``name`` (a Base, Workspace or Toolkit)."""
        d = self.defs.by_name[name]
        assert not isinstance(d, (Env, Task)), f"{name} is a {d.kind}, not a layer"
        return d

    @property
    def graph(self) -> nx.DiGraph:
        """The edges as a networkx ``DiGraph`` (dependency -> dependent), built once."""
        g = self._memo.get("nx")
        if g is None:
            g = self._memo["nx"] = _to_networkx(self.preds)
        return g

    def generations(self, nodes: Iterable[str] | None = None) -> list[list[str]]:
        """Topological generations (dependencies first), optionally of a subset of nodes
        (edges from outside the subset do not count, as in networkx's subgraph)."""
        if nodes is None:
            gens = self._memo.get("generations")
            if gens is None:
                gens = _generations(self.preds, None)
                assert gens is not None, "build_graph checked the graph is acyclic"
                self._memo["generations"] = gens
            return [list(g) for g in gens]
        gens = _generations(self.preds, {n for n in nodes if n in self.preds})
        assert gens is not None, "build_graph checked the graph is acyclic"
        return gens

    def dependencies(self, name: str) -> tuple[str, ...]:
        """Direct dependencies of ``name``, in definition order for an Env, else sorted."""
        d = self.defs.by_name[name]
        if isinstance(d, Env):
            deps = [d.base] + ([d.workspace] if d.workspace else []) + list(d.toolkits)
            return tuple(dict.fromkeys(deps))
        return tuple(sorted(self.preds[name]))

    def layer_dependencies(self, name: str) -> tuple[str, ...]:
        """The layers that must be built before layer ``name``: its direct dependencies, with
        an Env (a Dockerfile base's ``FROM envbuild.invalid/env/E``) replaced by E's layers."""
        by_name = self.defs.by_name
        deps = self.dependencies(name)
        if not any(isinstance(by_name[dep], Env) for dep in deps):
            return deps if not isinstance(by_name[name], Env) else tuple(sorted(set(deps)))
        out: list[str] = []
        for dep in deps:
            if isinstance(by_name[dep], Env):
                out.extend(self.env_layers(dep))
            else:
                out.append(dep)
        return tuple(sorted(set(out)))

    def closure(self, names: Iterable[str]) -> set[str]:
        """``names`` and everything they depend on, transitively."""
        out: set[str] = set()
        preds = self.preds
        stack = [n for n in names if n in preds]  # as networkx: an unknown name is an error
        missing = [n for n in names if n not in preds]
        if missing:
            raise KeyError(missing[0])
        while stack:
            n = stack.pop()
            if n not in out:
                out.add(n)
                stack.extend(preds[n])
        return out

    def base_chain(self, name: str) -> tuple[str, ...]:
        """The layer chain of Base ``name``: root base first, ``name`` itself last."""
        chain = self._chains.get(name)
        if chain is None:
            base = self.defs.by_name[name]
            assert isinstance(base, Base), name
            parent = base.parent
            chain = (self.base_chain(parent) if parent else ()) + (name,)
            self._chains[name] = chain
        return chain

    def env_layers(self, name: str) -> tuple[str, ...]:
        """An Env's layers bottom to top: base chain (root first), workspace, toolkits as listed."""
        env = self.defs.by_name[name]
        assert isinstance(env, Env), name
        ws = (env.workspace,) if env.workspace else ()
        return self.base_chain(env.base) + ws + tuple(env.toolkits)


def build_graph(defs: DefinitionSet, *, unparsed: frozenset[str] = frozenset()) -> EnvGraph:
    """Check the references between ``defs`` and return their DAG; raise ``PlanError`` if not.

    ``unparsed``: names of documents that exist but did not validate (``LoadResult``); a
    reference to one is not reported (its document's own problem is) and adds no edge."""
    by_name = defs.by_name
    preds: dict[str, list[str]] = {n: [] for n in by_name}
    problems = check_references(by_name, by_name.values(), preds, unparsed)
    graph = EnvGraph(defs=defs, preds=preds)
    gens = _generations(preds, None)
    if gens is None:
        problems.extend(_cycles(graph.graph, by_name))
    else:
        graph._memo["generations"] = gens
    if problems:
        raise PlanError(problems)
    return graph


def check_references(by_name: Mapping[str, Definition], definitions: Iterable[Definition],  # noqa: C901  a branch per definition kind, each a line or two of the one ref() check
                     preds: dict[str, list[str]],
                     unparsed: frozenset[str] = frozenset()) -> list[Problem]:
    """``build_graph``'s checks of the references of ``definitions`` (each in ``by_name``,
    the whole tree): the problems, in order; each resolved reference is added to
    ``preds[name]`` (once). Cycles are not looked for here."""
    problems: list[Problem] = []
    kinds: list[dict[str, list[str]]] = []

    def names_of(want: str) -> list[str]:  # the candidates of a hint, made on the first one
        if not kinds:
            kinds.append({})
            for n, d in by_name.items():
                kinds[0].setdefault(d.kind, []).append(n)
        return kinds[0].get(want, [])

    def ref(d: Definition, target: str, want: str, paths: Sequence[str], what: str) -> bool:
        """Check one reference; add its edge when it resolves to the right kind."""
        t = by_name.get(target)
        if t is None and target in unparsed:
            return False
        if t is None:
            problems.append(_problem(d, paths, f"{what} {target!r}: no {want} with that name",
                                     did_you_mean(target, names_of(want))))
            return False
        if t.kind != want:
            article = "an" if want[0] in "AEIOU" else "a"
            problems.append(_problem(d, paths, f"{what} {target!r} is a {t.kind}, not {article} "
                                     f"{want}",
                                     did_you_mean(target, names_of(want))))
            return False
        deps = preds[d.name]
        if target not in deps:  # one edge per pair, as a DiGraph keeps it
            deps.append(target)
        return True

    for d in definitions:
        if isinstance(d, Base):
            if d.parent is not None:
                ref(d, d.parent, "Base", ("from.base", "from"), "from base")
            for env_name in getattr(d.source, "envs", ()):
                ref(d, env_name, "Env", ("from.dockerfile", "from"),
                    "Dockerfile FROM envbuild.invalid/env/NAME:")
        elif isinstance(d, (Workspace, Toolkit)):
            if ref(d, d.build_on, "Base", ("build_on",), "build_on"):
                base = cast(Base, by_name[d.build_on])  # ref checked its kind
                if d.requires_abi and base.abi not in d.requires_abi:
                    problems.append(_problem(
                        d, ("build_on", "requires.abi"),
                        f"build_on {d.build_on!r} offers abi {base.abi!r}, but this "
                        f"{d.kind} requires {list(d.requires_abi)}",
                        f"add {base.abi!r} to requires.abi, or build on a base that offers "
                        f"one of {list(d.requires_abi)}"))
        elif isinstance(d, Env):
            _check_env(d, ref, by_name, problems)
        elif isinstance(d, Task):
            ref(d, d.env, "Env", ("env",), "env")
    return problems


def check_tree(root: Path | str, parse_cache: ParseCache | None = None) -> EnvGraph:
    """Load the definitions under ``root`` and check their graph, reporting every problem of
    both in one ``DefinitionError``: the graph checks (references, cycles, ABI) run over every
    document that validated, also when others did not. Graph problems alone raise
    ``PlanError``, as ``build_graph`` does."""
    from envbuild.defs.load import collect_definitions

    return check_loaded(collect_definitions(root, parse_cache))


def check_loaded(result: LoadResult) -> EnvGraph:
    """``check_tree`` of a tree already loaded (``collect_definitions``, or a git revision
    read from git objects: ``envbuild.build.gitrev``)."""
    try:
        graph = build_graph(result.defs, unparsed=result.unparsed_names)
    except PlanError as e:
        if not result.problems:
            raise
        raise DefinitionError([*result.problems, *e.problems]) from None
    if result.problems:
        raise DefinitionError(list(result.problems))
    return graph


def _check_env(env: Env, ref, by_name, problems: list[Problem]) -> None:
    base_ok = ref(env, env.base, "Base", ("base",), "base")
    used: list[tuple[str, str]] = []  # (field path, name) of resolved workspace/toolkits
    if env.workspace is not None and ref(env, env.workspace, "Workspace", ("workspace",),
                                         "workspace"):
        used.append(("workspace", env.workspace))
    for i, tk in enumerate(env.toolkits):
        if ref(env, tk, "Toolkit", (f"toolkits[{i}]", "toolkits"), "toolkit"):
            used.append((f"toolkits[{i}]", tk))
    if base_ok:
        env_abi = by_name[env.base].abi
        for path, n in used:
            layer = by_name[n]
            built_on = by_name.get(layer.build_on)
            if not isinstance(built_on, Base):
                continue  # already reported against the layer itself
            allowed = layer.requires_abi or (built_on.abi,)
            if env_abi not in allowed:
                problems.append(_problem(
                    env, (path,),
                    f"{layer.kind} {n!r} is not compatible with base {env.base!r}: it requires "
                    f"abi {list(allowed)}, the base offers {env_abi!r}",
                    f"add {env_abi!r} to requires.abi of {n!r} if it really works there"))
    tks = [(p, n) for p, n in used if p.startswith("toolkits")]
    for j in range(len(tks)):
        for i in range(j):
            (_, a), (pb, b) = tks[i], tks[j]
            pa_, pb_ = by_name[a].prefix, by_name[b].prefix
            if a == b:
                problems.append(_problem(env, (pb,), f"toolkit {a!r} is listed twice",
                                         "list each toolkit once"))
            elif _prefix_overlap(pa_, pb_):
                problems.append(_problem(
                    env, (pb,),
                    f"toolkits {a!r} ({pa_}) and {b!r} ({pb_}) have overlapping prefixes",
                    "each toolkit in an env needs its own prefix; one cannot be under another"))


def _to_networkx(preds: dict[str, list[str]]) -> nx.DiGraph:
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(preds)
    g.add_edges_from((dep, n) for n, deps in preds.items() for dep in deps)
    return g


def _generations(preds: dict[str, list[str]], nodes: set[str] | None
                 ) -> list[list[str]] | None:
    """Kahn's topological generations of ``nodes`` (None = all), each sorted; None if the
    (sub)graph has a cycle. Same generations as ``networkx.topological_generations``."""
    if nodes is None:
        indegree = {n: len(deps) for n, deps in preds.items()}
    else:
        indegree = {n: sum(1 for d in preds[n] if d in nodes) for n in nodes}
    succs: dict[str, list[str]] = {}
    for n in indegree:
        for dep in preds[n]:
            if nodes is None or dep in nodes:
                succs.setdefault(dep, []).append(n)
    current = [n for n, k in indegree.items() if k == 0]
    out: list[list[str]] = []
    done = 0
    while current:
        out.append(sorted(current))
        done += len(current)
        following = []
        for n in current:
            for m in succs.get(n, ()):
                k = indegree[m] - 1
                indegree[m] = k
                if k == 0:
                    following.append(m)
        current = following
    return out if done == len(indegree) else None


def _cycles(g: nx.DiGraph, by_name) -> list[Problem]:
    """One problem per strongly connected component that is a cycle."""
    import networkx as nx

    if nx.is_directed_acyclic_graph(g):
        return []
    out = []
    for comp in nx.strongly_connected_components(g):
        if len(comp) == 1 and not g.has_edge(next(iter(comp)), next(iter(comp))):
            continue
        start = min(comp)
        # Edges point dependency -> dependent; walk them backwards to print references
        # ("a -> b" = a refers to b), starting from the smallest name for stable output.
        cycle = [e[0] for e in nx.find_cycle(g.subgraph(comp).reverse(copy=False), start)]
        text = " -> ".join(cycle + [cycle[0]])
        d = by_name[start]
        out.append(_problem(d, ("from.base", "from"), f"cycle of definitions: {text}",
                            "a base cannot be stacked on itself, directly or indirectly"))
    return out
