"""What the build of one layer is given and what it reports: plain data (no side effects).

The engine turns a plan into ``LayerJob``\\ s; an executor (``envbuild.build.executor``, or the
Ray one) builds each and reports ``BuildEvent``\\ s to a ``Progress`` callback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from envbuild.defs.model import LayerDefinition


@dataclasses.dataclass(frozen=True)
class LayerJob:
    """One layer to build. ``lower_keys`` are the keys of the layers to build on, topmost
    first; ``build_env`` the environment steps see (the chain's merged config env)."""

    name: str
    key: str
    definition: LayerDefinition
    lower_keys: tuple[str, ...]
    pins: Mapping[str, str]
    build_env: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class BuildEvent:
    """Progress of one layer: ``phase`` is queued, waiting (for the node's disk budget),
    importing, step, packing, done, cached, failed or skipped; ``step``/``steps`` count
    run/copy steps, ``detail`` is free text."""

    name: str
    phase: str
    step: int = 0
    steps: int = 0
    detail: str = ""
    seconds: float = 0.0
    node: str = ""  # where it ran (the Ray executor's node id; "" for a local build)


Progress = Callable[[BuildEvent], None]
