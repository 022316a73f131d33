"""The planner: definitions + pinned inputs + key lookups -> a ``BuildPlan`` (plain data).

Pure. It never builds, never opens the store itself: ``lookup(key)`` is injected (a store's key
record lookup, or None when there is no store yet, which makes every layer ``missing``).
Executors take the plan and act on it; ``envbuild plan`` prints it (a dry run for free).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Literal

from envbuild.defs.model import LAYER_KINDS, Env, Task
from envbuild.errors import PlanError, Problem
from envbuild.plan.graph import EnvGraph, did_you_mean
from envbuild.plan.keys import KeySet, PinnedInputs, compute_keys
from envbuild.plan.taskplan import hidden_name

Status = Literal["cached", "missing"]
#: key -> the store's record of the layer built for it, or None. The record's shape is the
#: store's business; the planner only asks "is there one".
Lookup = Callable[[str], Any]


@dataclasses.dataclass(frozen=True)
class LayerStep:
    """One layer to have: built already (``cached``) or to build (``missing``).

    ``depends_on`` are the layer names that must exist first (a Base's parent, a layer's
    build_on base, the layers of an env a Dockerfile base's ``FROM`` names);
    ``generation`` is its topological generation among the planned layers
    (0 = depends on nothing). Two steps may share a key (identically defined layers): the
    executor builds that key once.
    """

    name: str
    kind: str
    key: str
    depends_on: tuple[str, ...]
    status: Status
    generation: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "key": self.key,
                "depends_on": list(self.depends_on), "status": self.status}


@dataclasses.dataclass(frozen=True)
class EnvPlan:
    """An env to (re-)lock: its layer names bottom to top."""

    name: str
    layers: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "layers": list(self.layers)}


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """A task, the env it grades in, and its hidden layer (``envbuild.plan.taskplan``):
    ``hidden`` its name (``<task>.hidden``), ``key`` its key and ``status`` whether the store
    has it (``cached``), not (``missing``), or, when the hidden source was not pinned (a tree
    read from git objects), ``not keyed`` and no key. Built with the layers of its env, locked
    with it (``envbuild build``, ``envbuild lock TASK``)."""

    name: str
    env: str
    key: str | None = None
    status: Literal["cached", "missing", "not keyed"] = "not keyed"
    depends_on: tuple[str, ...] = ()  # the env's layers: the hidden layer is built over them

    @property
    def hidden(self) -> str:
        return hidden_name(self.name)

    def step(self) -> LayerStep:
        """The hidden layer as a step to build (kind ``Task``), once it has a key."""
        assert self.key is not None and self.status != "not keyed", self
        return LayerStep(name=self.hidden, kind="Task", key=self.key, depends_on=self.depends_on,
                         status=self.status, generation=0)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "env": self.env,
                "hidden": {"name": self.hidden, "key": self.key, "status": self.status}}


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Layers in topological generations (then by name), envs and tasks by name, and the
    keys used."""

    layers: tuple[LayerStep, ...]
    envs: tuple[EnvPlan, ...]
    keys: KeySet = dataclasses.field(repr=False)
    tasks: tuple[TaskPlan, ...] = ()

    @property
    def generations(self) -> list[list[LayerStep]]:
        out: list[list[LayerStep]] = []
        for step in self.layers:
            if step.generation == len(out):
                out.append([])
            out[step.generation].append(step)
        return out

    @property
    def steps(self) -> tuple[LayerStep, ...]:
        """What a build has to have: the layers, then each keyed task's hidden layer."""
        return self.layers + tuple(t.step() for t in self.tasks if t.key is not None)

    @property
    def missing(self) -> tuple[LayerStep, ...]:
        return tuple(s for s in self.layers if s.status == "missing")

    def to_json(self) -> dict[str, Any]:
        return {"layers": [s.to_json() for s in self.layers],
                "envs": [e.to_json() for e in self.envs],
                "tasks": [t.to_json() for t in self.tasks]}


def select(graph: EnvGraph, targets: Iterable[str] | None) -> set[str]:
    """The names to plan: ``targets`` and their dependencies, or everything."""
    if targets is None:
        return set(graph.defs.by_name)
    targets = list(targets)
    unknown = [t for t in targets if t not in graph.defs.by_name]
    if unknown:
        raise PlanError([Problem("<command line>", 0, 0, f"no definition named {t!r}",
                                 hint=did_you_mean(t, graph.defs.by_name)) for t in unknown])
    return graph.closure(targets)


def make_plan(graph: EnvGraph, pinned: PinnedInputs, lookup: Lookup | None = None,
              targets: Iterable[str] | None = None, *, keys: KeySet | None = None) -> BuildPlan:
    """Plan ``targets`` (names of any kind, plus their dependencies; None = everything).

    ``keys`` may be passed when already computed (``compute_keys(graph, pinned)``).
    """
    keys = keys if keys is not None else compute_keys(graph, pinned)
    chosen = select(graph, targets)
    defs = graph.defs.by_name
    steps = []
    # generations over the envs too (a Dockerfile base can build on an env), envs and tasks
    # left out
    everything = targets is None  # then the graph's own generations, computed once
    gens = [[n for n in names if defs[n].kind in LAYER_KINDS]
            for names in graph.generations(None if everything else chosen)]
    for gen, names in enumerate(g for g in gens if g):
        for n in names:
            key = keys.layers[n]
            cached = lookup is not None and lookup(key) is not None
            steps.append(LayerStep(name=n, kind=defs[n].kind, key=key,
                                   depends_on=graph.layer_dependencies(n),
                                   status="cached" if cached else "missing", generation=gen))
    envs = tuple(EnvPlan(name=n, layers=graph.env_layers(n))
                 for n in sorted(chosen) if isinstance(defs[n], Env))
    tasks = tuple(_task_plan(t, keys.tasks.get(n), lookup, graph.env_layers(t.env))
                  for n in sorted(chosen) if isinstance(t := defs[n], Task))
    return BuildPlan(layers=tuple(steps), envs=envs, keys=keys, tasks=tasks)


def _task_plan(task: Task, key: str | None, lookup: Lookup | None,
               env_layers: tuple[str, ...]) -> TaskPlan:
    if key is None:
        return TaskPlan(name=task.name, env=task.env, depends_on=env_layers)
    cached = lookup is not None and lookup(key) is not None
    return TaskPlan(name=task.name, env=task.env, key=key,
                    status="cached" if cached else "missing", depends_on=env_layers)
