"""Whatever a document holds, the loader answers with problems, never with a crash."""

from __future__ import annotations

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envbuild.defs.load import _load_file
from envbuild.errors import Problem

VALID = [
    {"apiVersion": "envbuild/v1", "kind": "Base", "name": "b", "abi": "a",
     "from": {"rootfs": {"path": "r", "sha256": "0" * 64}},
     "steps": [{"run": "ls", "env": {"A": "1"}}, {"copy": {"src": "s", "dest": "/d", "mode": "0644"}}],
     "config": {"env": {"L": "C"}, "cmd": ["sh"]}},
    {"apiVersion": "envbuild/v1", "kind": "Workspace", "name": "w", "build_on": "b",
     "source": {"git": {"url": "u", "rev": "r"}}, "check": ["true"], "requires": {"abi": ["a"]}},
    {"apiVersion": "envbuild/v1", "kind": "Env", "name": "e", "base": "b", "toolkits": ["t"]},
]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=8), st.sampled_from(["run", "copy", "Env", "envbuild/v1"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc_index=st.integers(0, len(VALID) - 1), pick=st.integers(0, 10**6), value=values,
       delete=st.booleans())
def test_any_mutation_gives_problems_not_crashes(tmp_path, doc_index, pick, value, delete):
    doc = copy.deepcopy(VALID[doc_index])
    paths = [p for p in _paths(doc) if p]
    path = paths[pick % len(paths)]
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    file = tmp_path / "a.yaml"
    file.write_text(yaml.safe_dump(doc))
    problems: list[Problem] = []
    definitions = _load_file(file, "a.yaml", problems)
    assert len(definitions) + bool(problems) == 1
    for p in problems:
        assert p.file == "a.yaml" and p.message and p.line >= 0
