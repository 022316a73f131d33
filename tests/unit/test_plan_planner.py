"""The planner: plain data in topological generations, cached/missing from an injected lookup."""

from __future__ import annotations

import pytest

from envbuild.errors import PlanError
from envbuild.plan.changes import diff_inputs, diff_keys, explain
from envbuild.plan.graph import build_graph
from envbuild.plan.keys import compute_keys
from envbuild.plan.planner import EnvPlan, make_plan
from tests.unit.test_plan_support import base, defset, env, fake_pins, tk, ws

DOCS = [base("root"), base("py", src={"base": "root"}), ws("req", "py"), tk("rg", "py"),
        tk("jq", "root", requires={"abi": ["deb12"]}),
        env("swe", "py", "req", ["rg"]), env("tools", "root", toolkits=["jq"])]


def plan(targets=None, lookup=None, docs=DOCS):
    d = defset(*docs)
    return make_plan(build_graph(d), fake_pins(d), lookup, targets)


def test_everything_is_missing_without_a_store():
    p = plan()
    assert [(s.generation, s.name) for s in p.layers] == [
        (0, "root"), (1, "jq"), (1, "py"), (2, "req"), (2, "rg")]
    assert {s.status for s in p.layers} == {"missing"}
    assert p.envs == (EnvPlan("swe", ("root", "py", "req", "rg")), EnvPlan("tools", ("root", "jq")))
    assert [[s.name for s in g] for g in p.generations] == [["root"], ["jq", "py"], ["req", "rg"]]
    by = {s.name: s for s in p.layers}
    assert by["py"].depends_on == ("root",) and by["req"].depends_on == ("py",)


def test_lookup_marks_cached_layers():
    first = plan()
    have = {first.layers[0].key: object()}
    p = plan(lookup=have.get)
    assert [s.status for s in p.layers] == ["cached"] + ["missing"] * 4
    assert [s.name for s in p.missing] == ["jq", "py", "req", "rg"]


def test_targets_include_their_dependencies():
    p = plan(["req"])
    assert [s.name for s in p.layers] == ["root", "py", "req"] and p.envs == ()
    p = plan(["tools"])
    assert [s.name for s in p.layers] == ["root", "jq"]
    assert [e.name for e in p.envs] == ["tools"]


def test_unknown_target_has_a_hint():
    with pytest.raises(PlanError) as info:
        plan(["swf"])
    (problem,) = info.value.problems
    assert "'swf'" in problem.message and "'swe'" in problem.hint


def test_json_shape():
    out = plan().to_json()
    assert set(out) == {"layers", "envs", "tasks"}
    assert out["tasks"] == []
    assert set(out["layers"][0]) == {"name", "kind", "key", "depends_on", "status"}
    assert out["envs"][0] == {"name": "swe", "layers": ["root", "py", "req", "rg"]}


# ---------------------------------------------------------------------- changes


def keyset(docs):
    d = defset(*docs)
    return compute_keys(build_graph(d), fake_pins(d))


def test_diff_keys_reports_rebuilds_and_relocks():
    old = keyset(DOCS)
    new_docs = [d for d in DOCS if d["name"] != "rg"] + [
        tk("rg", "py", steps=[{"run": "cargo install ripgrep"}]),
        tk("fd", "py"), env("new", "py", toolkits=["fd"])]
    changes = diff_keys(old, keyset(new_docs))
    assert changes.rebuild == ("fd", "rg")
    assert changes.relock == ("new", "swe")


def test_a_renamed_identical_layer_is_not_rebuilt():
    old = keyset([base("b"), tk("t", "b", "/opt/t")])
    new = keyset([base("b"), tk("t2", "b", "/opt/t")])
    assert diff_keys(old, new).rebuild == ()


def test_diff_inputs_names_the_changed_leaf():
    old = keyset([base("b"), tk("t", "b", steps=[{"run": "true"}, {"run": "apt-get install x"}])])
    new = keyset([base("b"), tk("t", "b", steps=[{"run": "true"},
                                                 {"run": "apt-get install x y"}])])
    e = explain("t", "Toolkit", new, old)
    assert [c.render() for c in e.changes] == [
        "steps[1].run: 'apt-get install x' -> 'apt-get install x y'"]
    assert e.old_digest != e.digest
    assert explain("t", "Toolkit", new).changes is None


def test_diff_inputs_absent_and_empty():
    changes = diff_inputs({"a": {}, "b": [1]}, {"a": {"x": 1}, "b": [1, 2]})
    assert [c.render() for c in changes] == ["a: {} -> (absent)", "a.x: (absent) -> 1",
                                             "b[1]: (absent) -> 2"]


def test_explain_an_env_shows_its_lock_inputs():
    ks = keyset(DOCS)
    e = explain("swe", "Env", ks)
    assert e.digest == ks.env_locks["swe"]
    assert [x["key"] for x in e.inputs["layers"]] == [ks.layers[n] for n in ("root", "py", "req", "rg")]
