"""A task's hidden layer, planned: the workspace it is built as, and its key (issue 35).

A Task's ``hidden:`` source (any workspace source kind) is built exactly as a workspace
layer is (``envbuild.build.executor``): a ``Workspace`` made here (``hidden_definition``,
named ``<task>:hidden``, its source the task's ``hidden``, its ``dest`` the task's
``workdir``, no steps) over the task's env layers, so the directories below ``workdir`` it
writes into keep the env's owners and modes (``workdir`` itself takes the hidden directory's
mode, as a workspace's ``dest`` takes its source's). Its key is its own:

    ``"sha256:" + sha256(b"envbuild.task-hidden.v1\\0" + canonical_json(inputs))``

with ``inputs`` = the hidden source's ``identity()`` and its pinned digest, the workdir, the
framing, and the keys of the env layers it is built over (bottom to top: the bytes of the
directories it copies up come from them). Its own tag keeps it from ever equalling a
workspace's key. The task's name is not in it (two tasks with one hidden tree over one env
share a blob), nor its grade command (that is the task lock's config, not the layer).

The hidden layer appears in no env lock: only the task lock (``runtime_shim.node.tasklock``)
names it. Pure: no disk, no processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from envbuild.canonical import canonical_json
from envbuild.defs.model import Framing, Task, Workspace

HIDDEN_KEY_TAG = b"envbuild.task-hidden.v1\0"
#: the field of ``PinnedInputs[task]`` that holds the hidden source's digest
HIDDEN_PIN = "hidden"
#: the framing of every hidden layer (a task names none)
HIDDEN_FRAMING: Framing = "lazy"


def hidden_name(task: str) -> str:
    """The name a task's hidden layer is built and reported under (``:`` is in no
    definition's name, so it never equals one)."""
    return f"{task}:hidden"


def hidden_definition(task: Task) -> Workspace:
    """The workspace a task's hidden layer is built as (its paths resolve against the task's
    file: ``origin``). ``build_on`` is empty: its lowers are the task env's layers, given by
    the caller (``hidden_job`` in ``envbuild.build.engine``)."""
    return Workspace(name=hidden_name(task.name), origin=task.origin, build_on="",
                     source=task.hidden, dest=task.workdir, framing=HIDDEN_FRAMING)


def hidden_key_inputs(task: Task, pins: Mapping[str, str], env_layer_keys: Sequence[str]
                      ) -> dict[str, Any]:
    """The key inputs of ``task``'s hidden layer; ``pins`` are the task's pins (``hidden``),
    ``env_layer_keys`` its env's layer keys bottom to top."""
    return {"kind": "TaskHidden", "source": task.hidden.identity(),
            "pinned": {"source": pins[HIDDEN_PIN]}, "dest": task.workdir,
            "framing": HIDDEN_FRAMING, "lowers": list(env_layer_keys)}


def hidden_key(inputs: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(HIDDEN_KEY_TAG + canonical_json(inputs)).hexdigest()
