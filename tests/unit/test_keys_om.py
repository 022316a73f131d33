"""The O(m) rule (DESIGN.md): m base updates cost m builds, not m·N.

Layers built *on* a base key on its abi, so changing a base's steps changes exactly the keys of
the changed bases (and their child bases); everything on them is reused and only envs re-lock.
Changing an abi — or opting a layer into ``pin: digest`` — does reach the dependents.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from envbuild.plan.changes import diff_keys
from envbuild.plan.graph import build_graph
from envbuild.plan.keys import compute_keys
from tests.unit.test_plan_support import base, defset, env, fake_pins, tk, ws


def world(m, n, *, changed=frozenset(), abi_of=None, digest_pinned=frozenset()):
    """m bases sharing an abi, n workspaces and n toolkits spread over them, one env each."""
    abi_of = abi_of or {}
    docs = []
    for i in range(m):
        steps = [{"run": "apt-get install -y python3" + (" git" if i in changed else "")}]
        docs.append(base(f"b{i}", abi=abi_of.get(i, "deb12"), steps=steps))
    for j in range(n):
        on = j % m
        req = {"requires": {"abi": ["deb12", "deb12-next"]}}
        pin = {"pin": "digest"} if j in digest_pinned else {}
        docs.append(ws(f"w{j}", f"b{on}", path=f"src{j}", steps=[{"run": f"make {j}"}],
                       **req, **pin))
        docs.append(tk(f"t{j}", f"b{on}", **req))
        docs.append(env(f"e{j}", f"b{on}", f"w{j}", [f"t{j}"]))
    d = defset(*docs)
    return compute_keys(build_graph(d), fake_pins(d))


sizes = st.tuples(st.integers(1, 6), st.integers(1, 40))


@settings(max_examples=40, deadline=None)
@given(sizes.flatmap(lambda mn: st.tuples(
    st.just(mn), st.frozensets(st.integers(0, mn[0] - 1), min_size=1))))
def test_changing_base_steps_changes_exactly_those_base_keys(args):
    (m, n), changed = args
    before, after = world(m, n), world(m, n, changed=changed)
    differing = {k for k in after.layers if after.layers[k] != before.layers[k]}
    assert differing == {f"b{i}" for i in changed}
    # ... and every env on a changed base is re-locked, but nothing is rebuilt on top of it
    changes = diff_keys(before, after)
    assert set(changes.rebuild) == differing
    assert set(changes.relock) == {f"e{j}" for j in range(n) if j % m in changed}


@settings(max_examples=25, deadline=None)
@given(sizes.flatmap(lambda mn: st.tuples(st.just(mn), st.integers(0, mn[0] - 1))))
def test_changing_a_base_abi_changes_its_dependents(args):
    (m, n), i = args
    before, after = world(m, n), world(m, n, abi_of={i: "deb12-next"})
    differing = {k for k in after.layers if after.layers[k] != before.layers[k]}
    on_i = {f"{p}{j}" for j in range(n) if j % m == i for p in "wt"}
    # the base's own bytes did not change (its abi is a promise, not content): only the layers
    # built against the abi move
    assert differing == on_i


@settings(max_examples=25, deadline=None)
@given(sizes.flatmap(lambda mn: st.tuples(
    st.just(mn), st.frozensets(st.integers(0, mn[1] - 1)))))
def test_pin_digest_dependents_rebuild_with_their_base(args):
    (m, n), pinned = args
    before = world(m, n, digest_pinned=pinned)
    after = world(m, n, changed={0}, digest_pinned=pinned)
    differing = {k for k in after.layers if after.layers[k] != before.layers[k]}
    assert differing == {"b0"} | {f"w{j}" for j in pinned if j % m == 0}


def test_child_base_follows_its_parent_but_layers_on_it_do_not():
    def keys(step):
        d = defset(base("root", steps=[{"run": step}]), base("py", src={"base": "root"}),
                   ws("w", "py"), tk("t", "py", pin="digest"))
        return compute_keys(build_graph(d), fake_pins(d))

    a, b = keys("apt-get update"), keys("apt-get update && apt-get upgrade")
    assert {n for n in a.layers if a.layers[n] != b.layers[n]} == {"root", "py", "t"}
