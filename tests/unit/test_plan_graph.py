"""The definition graph: structure, and every problem it reports (all collected, with lines)."""

from __future__ import annotations

import pytest

from envbuild.errors import DefinitionError, PlanError
from envbuild.plan.graph import build_graph
from tests.unit.test_plan_support import base, defset, env, tk, ws


def problems(*docs):
    with pytest.raises(PlanError) as info:
        build_graph(defset(*docs))
    assert isinstance(info.value, DefinitionError)  # same reporting path as the loader's
    return info.value.problems


def test_structure_generations_chain_and_env_layers():
    g = build_graph(defset(
        base("root"), base("py", src={"base": "root"}),
        ws("req", "py"), tk("rg", "py"), tk("jq", "py"),
        env("swe", "py", "req", ["rg", "jq"]), env("bare", "root"),
    ))
    assert g.generations() == [["root"], ["bare", "py"], ["jq", "req", "rg"], ["swe"]]
    assert g.base_chain("py") == ("root", "py")
    assert g.env_layers("swe") == ("root", "py", "req", "rg", "jq")  # toolkits as listed
    assert g.env_layers("bare") == ("root",)
    assert g.dependencies("req") == ("py",)
    assert g.dependencies("swe") == ("py", "req", "rg", "jq")
    assert g.closure(["req"]) == {"root", "py", "req"}


def test_cycle_is_printed_in_reference_order():
    (p,) = problems(base("a", src={"base": "b"}, pos={"from.base": (4, 9)}),
                    base("b", src={"base": "a"}))
    assert "a -> b -> a" in p.message
    assert (p.file, p.line, p.column) == ("/repo/envdefs/base/a.yaml", 4, 9)


def test_self_cycle():
    (p,) = problems(base("a", src={"base": "a"}))
    assert "a -> a" in p.message


def test_missing_reference_points_at_the_field_with_a_hint_of_the_right_kind():
    (p,) = problems(base("debian-bookworm"), tk("debian-bookwork", "debian-bookworm"),
                    ws("w", "debian-bookwrm", pos={"build_on": (3, 11)}))
    assert p.file.endswith("workspaces/w.yaml") and (p.line, p.column) == (3, 11)
    assert p.path == "build_on"
    assert "'debian-bookwrm'" in p.message and "no Base" in p.message
    # the toolkit's name is closer, but only Bases are candidates for build_on
    assert "'debian-bookworm'" in p.hint


def test_missing_toolkit_in_env_points_at_its_list_item():
    (p,) = problems(base("b"), tk("ripgrep", "b"),
                    env("e", "b", toolkits=["ripgrep", "ripgrap"], pos={"toolkits[1]": (6, 5)}))
    assert (p.line, p.column, p.path) == (6, 5, "toolkits[1]")
    assert "ripgrep" in p.hint


def test_wrong_kind():
    ps = problems(base("b"), tk("t", "b"), ws("w", "t"), env("e", "t", toolkits=["b"]))
    msgs = sorted(p.message for p in ps)
    assert msgs == ["base 't' is a Toolkit, not a Base",
                    "build_on 't' is a Toolkit, not a Base",
                    "toolkit 'b' is a Base, not a Toolkit"]


def test_required_abi_must_admit_the_build_on_base():
    (p,) = problems(base("b", abi="deb12"), tk("t", "b", requires={"abi": ["deb11"]}))
    assert "'deb12'" in p.message and "deb11" in p.message
    build_graph(defset(base("b", abi="deb12"), tk("t", "b", requires={"abi": ["deb11", "deb12"]})))


def test_env_base_abi_must_be_admitted_by_its_layers():
    docs = [base("b12", abi="deb12"), base("b13", abi="deb13"), ws("w", "b12"), tk("t", "b12")]
    ps = problems(*docs, env("e", "b13", "w", ["t"], pos={"workspace": (3, 1)}))
    assert {p.path for p in ps} == {"workspace", "toolkits[0]"}
    assert all("'deb13'" in p.message for p in ps)
    # fine once the layers say they work on deb13 as well
    ok = [base("b12", abi="deb12"), base("b13", abi="deb13"),
          ws("w", "b12", requires={"abi": ["deb12", "deb13"]}),
          tk("t", "b12", requires={"abi": ["deb12", "deb13"]}), env("e", "b13", "w", ["t"])]
    build_graph(defset(*ok))
    # and a different base with the same abi is fine without requires
    build_graph(defset(base("b12", abi="deb12"), base("b12b", abi="deb12"), ws("w", "b12"),
                       env("e", "b12b", "w")))


@pytest.mark.parametrize("a,b,overlap", [
    ("/opt/a", "/opt/a", True),
    ("/opt/a", "/opt/a/b", True),
    ("/opt/a/b", "/opt/a", True),
    ("/opt/a", "/opt/ab", False),
    ("/opt/a", "/opt/b", False),
    ("/", "/opt/b", True),
])
def test_overlapping_toolkit_prefixes(a, b, overlap):
    docs = [base("b"), tk("ta", "b", a), tk("tb", "b", b), env("e", "b", toolkits=["ta", "tb"])]
    if overlap:
        (p,) = problems(*docs)
        assert p.path == "toolkits[1]" and "overlapping prefixes" in p.message
    else:
        build_graph(defset(*docs))


def test_toolkit_listed_twice():
    (p,) = problems(base("b"), tk("t", "b"), env("e", "b", toolkits=["t", "t"]))
    assert "listed twice" in p.message


def test_all_problems_are_collected_and_sorted():
    ps = problems(base("a", src={"base": "nope"}), ws("w", "zzz"), tk("t", "w"),
                  env("e", "a", "missing-ws"))
    assert len(ps) == 4
    assert ps == sorted(ps)
