"""Layer keys and env lock digests: what goes into a key, and what deliberately does not.

A **layer key** names *how* a layer is made: ``"sha256:" + sha256(b"envbuild.layer.v1\\0" +
canonical_json(inputs))``. ``inputs`` is a plain dict, kept so ``envbuild explain`` can print it
and diff it against another revision. Keys are computed only over pinned inputs
(``PinnedInputs``, produced by ``envbuild.build.pin``): a path becomes a tree digest, a git rev a
commit sha, an OCI tag a manifest digest.

In the key (each changes the bytes of the layer):

- ``kind`` — a Base imports its source into ``/``; a Workspace copies it to ``dest``; a Toolkit
  is confined to ``prefix``. The same fields under another kind build something else.
- the source's ``identity()`` plus its pinned digest (``pinned``).
- every step's ``identity()``; a ``copy`` step's ``src`` enters as a content digest in
  ``pinned`` (the path string is not identity, the bytes are).
- ``dest`` (Workspace), ``prefix`` (Toolkit): where the files land.
- ``framing``: lazy and compact framing produce different blob bytes.
- ``build_on`` (Workspace/Toolkit): the base's **abi**, not its key — the O(m) rule (DESIGN.md):
  updating a base without changing its abi must not rebuild every layer built on it. With
  ``pin: digest`` it is instead the keys of the whole base chain, so the layer rebuilds on every
  base change.
- ``parent`` (Base with ``from: {base: X}``): X's key. A Base is an ordinary layer chain: its
  upper dir is a diff against the exact bytes of its parent.
- ``from_envs`` (a Dockerfile base with ``FROM envbuild.invalid/env/E``, E an Env of the tree):
  E name -> E's **lock inputs digest** (below), not its lock's manifest digest: the lock
  digest names layer blobs whose bytes need not be reproducible across machines, the lock
  inputs are known at plan time, like a parent's key. It changes exactly when a layer key or a
  config of E changes.

Not in the key:

- ``name``: two identically defined layers produce identical bytes and should share one build
  and one blob. The planner keeps both names; the executor builds the key once.
- ``description``, ``labels``, ``origin`` (file, line, the absolute checkout path): metadata.
- ``check``: it verifies a layer in each env that uses it, it does not build anything. Editing a
  check must not rebuild a workspace.
- ``config``: runtime config (env vars, workdir, user) is not in the layer's bytes; it goes into
  the env's lock, so it is part of the env **lock inputs** below instead.
- ``requires.abi``: a compatibility constraint checked by the graph; the abi actually built
  against is in the key.
- the ``build_on`` base's *name*: moving a layer to another base that offers the same abi is
  exactly what the abi contract allows without a rebuild (``check:`` catches a broken promise).
- a Base's own ``abi``: a promise to dependents, not content. It reaches dependents' keys.
- ``debootstrap.mirror``: where bytes come from, not what they are (see the model).

**Env lock inputs**: an Env has no layer; it is (re-)locked. Its lock inputs are the ordered
layer names and keys plus the config of each of those layers and of the env itself, *unmerged*:
the lock step merges them (``$PATH`` expansion in layer order, ``envbuild.plan.lockspec``), and
any change to the merged result is a change to one of these, so this digest never misses a
re-lock (it may ask for one whose merged config comes out the same; a re-lock is cheap).
Digest tag ``envbuild.lock-inputs.v1``.

**Task hidden layers**: a Task has no layer of its own, but its ``hidden`` source is built as
a layer under a key of its own tag (``envbuild.task-hidden.v1``: ``envbuild.plan.taskplan``),
in ``KeySet.tasks``; its pinned digest is ``PinnedInputs[task]["hidden"]``.

Pure: no disk, no processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Collection, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from envbuild.canonical import canonical_json
from envbuild.defs.model import (
    LAYER_KINDS,
    Base,
    CopyStep,
    Definition,
    Env,
    LayerDefinition,
    Task,
    Toolkit,
    Workspace,
)
from envbuild.errors import bug
from envbuild.plan.taskplan import HIDDEN_PIN, hidden_key, hidden_key_inputs

LAYER_KEY_TAG = b"envbuild.layer.v1\0"
LOCK_INPUTS_TAG = b"envbuild.lock-inputs.v1\0"

#: definition name -> {input path (``"source"``, ``"from"``, ``"steps[2].copy.src"``) -> digest}.
#: Produced by ``envbuild.build.pin.pin_inputs``; the only way disk contents reach a key.
PinnedInputs = Mapping[str, Mapping[str, str]]

EMPTY_PINS: PinnedInputs = MappingProxyType({})


def _digest(tag: bytes, inputs: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(tag + canonical_json(inputs)).hexdigest()


def layer_key(inputs: Mapping[str, Any]) -> str:
    """``sha256:`` of the versioned canonical key inputs of one layer (see module docstring)."""
    return _digest(LAYER_KEY_TAG, inputs)


def lock_inputs_digest(inputs: Mapping[str, Any]) -> str:
    return _digest(LOCK_INPUTS_TAG, inputs)


def _steps(d: LayerDefinition) -> list[dict[str, Any]]:
    return [s.identity() for s in d.steps]


#: Source kinds whose identity() leaves the content out: a digest must be pinned as "source".
PINNED_SOURCE_KINDS = frozenset({"path", "git", "archive", "rootfs", "oci", "busybox",
                                 "dockerfile"})


def _check_pins(d: LayerDefinition, pins: Mapping[str, str]) -> None:
    """Every copy step and every pinnable source must have been pinned: never key a path."""
    source = getattr(d, "source", None)
    if source is not None and source.kind in PINNED_SOURCE_KINDS and "source" not in pins:
        raise bug(f"{d.name}: source was not pinned before keying")
    for i, s in enumerate(d.steps):
        if isinstance(s, CopyStep) and f"steps[{i}].copy.src" not in pins:
            raise bug(f"{d.name}: steps[{i}].copy.src was not pinned before keying")


def key_inputs(d: LayerDefinition, pins: Mapping[str, str], *, build_on_abi: str | None = None,
               build_on_chain_keys: tuple[str, ...] | None = None,
               parent_key: str | None = None,
               from_envs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The key input dict of one layer. Callers pass what the layer depends on (see docstring)."""
    _check_pins(d, pins)
    inputs: dict[str, Any] = {
        "kind": d.kind,
        "steps": _steps(d),
        "framing": d.framing,
        "pinned": dict(sorted(pins.items())),
    }
    if isinstance(d, Base):
        inputs["source"] = d.source.identity()
        if d.parent is not None:
            if parent_key is None:
                raise bug(f"{d.name}: parent key missing")
            inputs["parent"] = parent_key
        envs = getattr(d.source, "envs", ())
        if envs:  # only then: every other base keeps the key it had before the field existed
            if from_envs is None or set(from_envs) != set(envs):
                raise bug(f"{d.name}: lock inputs of its FROM envs missing")
            inputs["from_envs"] = dict(sorted(from_envs.items()))
    elif isinstance(d, (Workspace, Toolkit)):
        if isinstance(d, Workspace):
            inputs["source"] = d.source.identity()
            inputs["dest"] = d.dest
        else:
            inputs["prefix"] = d.prefix
        if d.pin == "digest":
            if build_on_chain_keys is None:
                raise bug(f"{d.name}: build_on chain keys missing")
            inputs["build_on"] = {"pin": "digest", "keys": list(build_on_chain_keys)}
        else:
            inputs["build_on"] = {"pin": "abi", "abi": build_on_abi}
    return inputs


@dataclasses.dataclass(frozen=True)
class KeySet:
    """Every key of one definition tree at one moment (a working tree or a git revision).

    ``layers``: layer name -> key; ``inputs``: layer name -> key input dict;
    ``env_locks``: env name -> lock inputs digest; ``env_inputs``: env name -> lock input dict;
    ``tasks``: task name -> hidden layer key.
    """

    layers: Mapping[str, str]
    inputs: Mapping[str, Mapping[str, Any]]
    env_locks: Mapping[str, str]
    env_inputs: Mapping[str, Mapping[str, Any]]
    #: task name -> its hidden layer's key (``envbuild.plan.taskplan``); a task whose hidden
    #: source was not pinned (a tree read from git objects) has none
    tasks: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def to_json(self) -> dict[str, Any]:
        return {"layers": dict(sorted(self.layers.items())),
                "envs": dict(sorted(self.env_locks.items()))}


@dataclasses.dataclass(frozen=True)
class Previous:
    """Keys already computed for another tree (``compute_keys(previous=...)``): a definition
    whose content is the same (``same(new, old)``), with the same pins and the same upstream
    keys/abi, has the same key by construction, so it is not keyed again."""

    graph: Any                                        # the other tree's EnvGraph
    pinned: PinnedInputs
    keys: KeySet
    same: Callable[[Definition, Definition], bool]


class KeyMemo(Protocol):
    """Keys remembered across runs (``envbuild.defs.parsecache.ParseCache``): ``ident(d)``
    names a definition's content (None: unknown, key it as usual); ``key(what)`` is the key
    recorded for ``what``, a string naming every input of one key (``note_key`` records)."""

    def ident(self, d: Definition) -> str | None: ...
    def key(self, what: str) -> str | None: ...
    def note_key(self, what: str, key: str) -> None: ...


class _Later:
    """Key inputs not computed yet: the arguments of ``key_inputs`` or ``lock_inputs``."""

    __slots__ = ("call", "args", "kwargs")

    def __init__(self, call: Callable[..., dict[str, Any]], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.call, self.args, self.kwargs = call, args, kwargs


class LazyInputs(Mapping[str, Mapping[str, Any]]):
    """A read-only name -> key input dict whose values for keys found in a ``KeyMemo`` are
    computed on first access (``explain`` reads one; ``plan`` reads none)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = raw

    def raw(self, name: str) -> Any:
        """The value as held: a dict, or the ``_Later`` that computes it."""
        return self._raw[name]

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        v = self._raw[name]
        if v.__class__ is _Later:
            v = self._raw[name] = v.call(*v.args, **v.kwargs)
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, name: object) -> bool:
        return name in self._raw


def _pins_text(pins: Mapping[str, str]) -> str:
    if len(pins) < 2:  # most definitions pin one path or none
        return "".join(f"{k}={v}" for k, v in pins.items())
    return "\0".join(f"{k}={v}" for k, v in sorted(pins.items()))


def compute_keys(graph, pinned: PinnedInputs, previous: Previous | None = None,
                 memo: KeyMemo | None = None, only: Collection[str] | None = None) -> KeySet:
    """Keys of every layer and lock digests of every env in ``graph`` (an ``EnvGraph``).

    Linear in the number of definitions: each layer is keyed once, memoised, what it depends on
    first (a base's parent, the envs a Dockerfile base builds on and their layers); workspaces
    and toolkits read only their base's abi (or, with ``pin: digest``, the chain keys). The
    graph is acyclic (``build_graph``), so the recursion ends. With ``previous``, only
    definitions that differ from it (or whose pins or upstreams do) are keyed; the others take
    the previous key and inputs. With ``memo``, a key whose inputs (definition content, pins,
    upstream keys/abi; an env's layers, their keys and definitions) were keyed before is looked
    up, and its input dict is computed only when read (``LazyInputs``). With ``previous`` and
    ``only`` (names of ``graph``, closed under dependents: whatever depends on one is in it),
    every name not in ``only`` takes previous's key or lock as it is, without a look.
    """
    keyer = _Keyer(graph, pinned, previous, memo)
    if only is None:
        for d in graph.defs.layers:
            keyer.key_of(d.name)
        for env in graph.defs.envs:
            keyer.env_lock(env.name)
    else:
        keyer.key_only(only)
    for task in graph.defs.tasks:
        keyer.task_key(task)
    return keyer.key_set()


_NO_PINS: Mapping[str, str] = MappingProxyType({})


def _raw(m: Mapping[str, Any], name: str) -> Any:
    return m.raw(name) if isinstance(m, LazyInputs) else m[name]


class _Keyer:
    """One ``compute_keys`` run: the keys and inputs found so far (each layer keyed once,
    what it depends on first), and how to take a key from ``previous`` or ``memo``."""

    def __init__(self, graph, pinned: PinnedInputs, previous: Previous | None,
                 memo: KeyMemo | None) -> None:
        self.graph, self.pinned, self.previous, self.memo = graph, pinned, previous, memo
        self.defs = graph.defs.by_name
        self.keys: dict[str, str] = {}
        self.inputs: dict[str, Any] = {}  # a dict, or the _Later that computes it
        self.env_inputs: dict[str, Any] = {}
        self.env_locks: dict[str, str] = {}
        self.task_keys: dict[str, str] = {}
        self.old = previous.graph.defs.by_name if previous is not None else {}
        self.old_inputs, self.old_env_inputs = ((previous.keys.inputs, previous.keys.env_inputs)
                                                if previous is not None else ({}, {}))
        self.idents: dict[str, str | None] = {}
        self.env_parts: dict[str, str | None] = {}
        self.ident = self._ident if memo is not None else None

    # ------------------------------------------------------------------ previous and memo

    def unchanged(self, d: Definition) -> Definition | None:
        """The previous definition of d's name if d's own content and pins are unchanged."""
        previous = self.previous
        if previous is None:
            return None
        d0 = self.old.get(d.name)
        if d0 is None or not previous.same(d, d0) or d.name not in previous.keys.layers:
            return None
        if self.pinned.get(d.name, _NO_PINS) != previous.pinned.get(d.name, _NO_PINS):
            return None
        return d0

    def reuse(self, name: str) -> str:
        assert self.previous is not None
        self.inputs[name] = _raw(self.old_inputs, name)
        k = self.keys[name] = self.previous.keys.layers[name]
        return k

    def _ident(self, d: Definition) -> str | None:
        try:
            return self.idents[d.name]
        except KeyError:
            assert self.memo is not None
            i = self.idents[d.name] = self.memo.ident(d)
            return i

    def remembered(self, kind: str, d: Definition, upstream: str
                   ) -> tuple[str | None, str | None]:
        """(what names this key's inputs, the key recorded for it) when ``memo`` knows ``d``."""
        if self.ident is None:
            return None, None
        i = self.ident(d)
        if i is None:
            return None, None
        assert self.memo is not None
        what = f"{kind}\0{i}\0{_pins_text(self.pinned.get(d.name, _NO_PINS))}\0{upstream}"
        return what, self.memo.key(what)

    def layer_part(self, n: str) -> str | None:
        """What an env's lock digest takes from its layer ``n``: name, key and definition."""
        try:
            return self.env_parts[n]
        except KeyError:
            assert self.ident is not None
            i = self.ident(self.defs[n])
            part = self.env_parts[n] = None if i is None else f"{n}={self.keys[n]}={i}"
            return part

    # ------------------------------------------------------------------ envs

    def env_lock(self, name: str) -> str:
        k = self.env_locks.get(name)
        if k is not None:
            return k
        layers = self.graph.env_layers(name)
        for n in layers:
            self.key_of(n)
        if self._previous_lock_holds(name, layers):
            assert self.previous is not None
            self.env_inputs[name] = _raw(self.old_env_inputs, name)
            k = self.env_locks[name] = self.previous.keys.env_locks[name]
            return k
        d = self.defs[name]
        what = None
        parts = [self.layer_part(n) for n in layers] if self.ident is not None else [None]
        if None not in parts:
            what, k = self.remembered("env", d, "\0".join(parts))  # type: ignore[arg-type]
            if k is not None:
                self.env_inputs[name] = _Later(lock_inputs, (self.graph, d, self.keys), {})
                self.env_locks[name] = k
                return k
        self.env_inputs[name] = lock_inputs(self.graph, d, self.keys)
        k = self.env_locks[name] = lock_inputs_digest(self.env_inputs[name])
        if what is not None:
            assert self.memo is not None
            self.memo.note_key(what, k)
        return k

    def _previous_lock_holds(self, name: str, layers) -> bool:
        """Whether the env, its layer list, and each layer's key and definition are
        previous's: then so is its lock."""
        previous = self.previous
        if previous is None or name not in previous.keys.env_locks:
            return False
        e0 = self.old.get(name)
        return (e0 is not None and previous.same(self.defs[name], e0)
                and layers == previous.graph.env_layers(name)
                and all(self.keys[n] == previous.keys.layers.get(n)
                        and previous.same(self.defs[n], self.old[n]) for n in layers))

    # ------------------------------------------------------------------ layers

    def key_of(self, name: str) -> str:
        k = self.keys.get(name)
        if k is not None:
            return k
        d = self.defs[name]
        found = self._base(d) if isinstance(d, Base) else self._stacked(d)
        if isinstance(found, str):
            return found  # previous's key
        what, k, kwargs = found
        pins = self.pinned.get(name, _NO_PINS)
        if k is not None:
            self.inputs[name] = _Later(key_inputs, (d, pins), kwargs)
            self.keys[name] = k
            return k
        self.inputs[name] = key_inputs(d, pins, **kwargs)
        k = self.keys[name] = layer_key(self.inputs[name])
        if what is not None:
            assert self.memo is not None
            self.memo.note_key(what, k)
        return k

    def _base(self, d: Base) -> str | tuple[str | None, str | None, dict[str, Any]]:
        """previous's key of the base ``d`` if it holds, else (what names its inputs for
        ``memo``, the key it recorded, the ``key_inputs`` arguments)."""
        parent = self.key_of(d.parent) if d.parent else None
        envs = getattr(d.source, "envs", ())
        from_envs = {e: self.env_lock(e) for e in envs} or None
        previous = self.previous
        if previous is not None and self.unchanged(d) is not None:
            if ((parent is None or parent == previous.keys.layers.get(d.parent or ""))
                    and (from_envs is None or all(previous.keys.env_locks.get(e) == v
                                                  for e, v in from_envs.items()))):
                return self.reuse(d.name)
        what, k = self.remembered("layer", d, f"{parent}\0{sorted((from_envs or {}).items())}")
        return what, k, {"parent_key": parent, "from_envs": from_envs}

    def _stacked(self, d) -> str | tuple[str | None, str | None, dict[str, Any]]:
        """``_base`` of a workspace or toolkit: it reads its base's abi, or with
        ``pin: digest`` the keys of its base chain."""
        base = self.defs[d.build_on]
        chain = (tuple(self.key_of(n) for n in self.graph.base_chain(d.build_on))
                 if d.pin == "digest" else None)
        previous = self.previous
        if previous is not None and self.unchanged(d) is not None:
            b0 = self.old.get(d.build_on)
            if b0 is not None and chain is None:
                if getattr(b0, "abi", None) == base.abi:
                    return self.reuse(d.name)
            elif b0 is not None and chain == tuple(
                    previous.keys.layers.get(n) for n in previous.graph.base_chain(d.build_on)):
                return self.reuse(d.name)
        what, k = self.remembered("layer", d, f"abi={base.abi}" if chain is None
                                  else "chain=" + ",".join(chain))
        return what, k, {"build_on_abi": base.abi, "build_on_chain_keys": chain}

    # ------------------------------------------------------------------ tasks

    def task_key(self, task: Task) -> None:
        """Key ``task``'s hidden layer (cheap: no memo) when its source was pinned."""
        pins = self.pinned.get(task.name, _NO_PINS)
        if HIDDEN_PIN in pins and task.env in self.defs:
            lowers = [self.key_of(n) for n in self.graph.env_layers(task.env)]
            self.task_keys[task.name] = hidden_key(hidden_key_inputs(task, pins, lowers))

    # ------------------------------------------------------------------ the run

    def key_only(self, only: Collection[str]) -> None:
        """previous's keys and locks, but those of ``only``, keyed again."""
        assert self.previous is not None
        pk = self.previous.keys
        old_inputs, old_env_inputs = self.old_inputs, self.old_env_inputs
        self.keys.update(pk.layers)
        self.inputs.update(old_inputs._raw if isinstance(old_inputs, LazyInputs) else old_inputs)
        self.env_locks.update(pk.env_locks)
        self.env_inputs.update(old_env_inputs._raw if isinstance(old_env_inputs, LazyInputs)
                               else old_env_inputs)
        for table in (self.keys, self.inputs, self.env_locks, self.env_inputs):
            for n in [*(table.keys() - self.defs.keys()), *(n for n in only if n in table)]:
                del table[n]
        for n in sorted(only):
            if self.defs[n].kind == "Env":
                self.env_lock(n)
            elif self.defs[n].kind in LAYER_KINDS:  # a Task has no key of its own yet
                self.key_of(n)

    def key_set(self) -> KeySet:
        envs = self.graph.defs.envs
        env_inputs = {e.name: self.env_inputs[e.name] for e in envs}  # definition order
        env_locks = {e.name: self.env_locks[e.name] for e in envs}
        inputs = self.inputs
        lazy = any(v.__class__ is _Later for v in inputs.values()) or any(
            v.__class__ is _Later for v in env_inputs.values())
        return KeySet(layers=MappingProxyType(self.keys),
                      inputs=LazyInputs(inputs) if lazy else MappingProxyType(inputs),
                      env_locks=MappingProxyType(env_locks),
                      env_inputs=LazyInputs(env_inputs) if lazy else MappingProxyType(env_inputs),
                      tasks=MappingProxyType(self.task_keys))


def lock_inputs(graph, env: Env, keys: Mapping[str, str]) -> dict[str, Any]:
    """What an env's lock is made of: ordered layer keys and their (unmerged) runtime config.

    Layer names are included because the lock records them (``org.envbuild.name``
    annotations); the env's own name is not: a renamed env is a new env anyway.
    """
    defs = graph.defs.by_name
    return {
        "layers": [{"name": n, "key": keys[n], "config": defs[n].config.identity()}
                   for n in graph.env_layers(env.name)],
        "config": env.config.identity(),
    }
