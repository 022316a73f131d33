"""A Dockerfile base on an env of its own tree (``FROM envbuild.invalid/env/NAME``, no digest):
a graph edge, planned after the env's layers, keyed on the env's lock inputs (issue 17)."""

from __future__ import annotations

import textwrap

import pytest

from envbuild.build.pin import snapshot
from envbuild.errors import DefinitionError, PlanError, SourceError
from envbuild.plan.planner import make_plan

OS = """\
apiVersion: envbuild/v1
kind: Base
name: os
abi: os-1
from: {{scratch: {{}}}}
steps:
  - run: echo {rev} > /etc/os-release
    network: none
"""
TOOL = """\
apiVersion: envbuild/v1
kind: Toolkit
name: tool
build_on: os
prefix: /opt/tool
steps:
  - run: echo {rev} > /opt/tool/v
    network: none
"""
ENV = """\
apiVersion: envbuild/v1
kind: Env
name: os-env
base: {base}
toolkits: [tool]
config:
  env: {{X: "{x}"}}
"""
DOCK = """\
apiVersion: envbuild/v1
kind: Base
name: dock
abi: dock-1
from:
  dockerfile: {context: ctx}
"""
OTHER = """\
apiVersion: envbuild/v1
kind: Base
name: other
abi: other-1
from: {{scratch: {{}}}}
steps:
  - run: echo {rev} > /x
    network: none
"""


def _tree(tmp_path, *, os_rev="1", tool_rev="1", x="1", other_rev="1", env_base="os",
          dockerfile="FROM envbuild.invalid/env/os-env\nRUN true\n"):
    defs = tmp_path / "envdefs"
    (defs / "base" / "ctx").mkdir(parents=True, exist_ok=True)
    (defs / "base" / "os.yaml").write_text(OS.format(rev=os_rev))
    (defs / "base" / "other.yaml").write_text(OTHER.format(rev=other_rev))
    (defs / "base" / "dock.yaml").write_text(DOCK)
    (defs / "base" / "ctx" / "Dockerfile").write_text(dockerfile)
    (defs / "tool.yaml").write_text(TOOL.format(rev=tool_rev))
    (defs / "env.yaml").write_text(ENV.format(base=env_base, x=x))
    return defs


def test_from_an_in_tree_env_is_an_edge_and_is_planned_after_the_envs_layers(tmp_path):
    ws = snapshot(_tree(tmp_path))
    assert ws.defs.by_name["dock"].source.envs == ("os-env",)
    assert ws.graph.graph.has_edge("os-env", "dock")
    assert ws.graph.dependencies("dock") == ("os-env",)
    assert ws.pinned["dock"]["source.from[0]"] == "env/os-env"
    plan = make_plan(ws.graph, ws.pinned, targets=["dock"])
    steps = {s.name: s for s in plan.layers}
    assert set(steps) == {"os", "tool", "dock"}, "the env's layers are planned with the base"
    assert steps["dock"].depends_on == ("os", "tool")
    assert steps["dock"].generation > max(steps["os"].generation, steps["tool"].generation)
    assert [e.name for e in plan.envs] == ["os-env"], "the env is locked too"
    gens = plan.generations  # contiguous although the env's generation holds no layer
    assert [s.name for s in gens[-1]] == ["dock"]


def test_key_follows_the_envs_lock_inputs_and_nothing_else(tmp_path):
    def key(**kw):
        return snapshot(_tree(tmp_path, **kw)).keys.layers["dock"]

    k0 = key()
    assert key() == k0
    assert key(other_rev="2") == k0, "a layer outside the env does not move the key"
    moved = {key(os_rev="2"), key(tool_rev="2"), key(x="2")}
    assert k0 not in moved and len(moved) == 3
    ws = snapshot(_tree(tmp_path))
    assert ws.keys.inputs["dock"]["from_envs"] == {"os-env": ws.keys.env_locks["os-env"]}


def test_a_base_without_env_upstreams_keeps_its_key_shape(tmp_path):
    ws = snapshot(_tree(tmp_path, dockerfile="FROM scratch\n"))
    assert "from_envs" not in ws.keys.inputs["dock"]
    assert ws.defs.by_name["dock"].source.envs == ()


def test_a_name_that_is_not_an_env_of_the_tree_is_one_line(tmp_path):
    with pytest.raises((PlanError, DefinitionError)) as e:
        snapshot(_tree(tmp_path, dockerfile="FROM envbuild.invalid/env/os-envv\n"))
    [p] = e.value.problems
    assert p.file.endswith("dock.yaml")
    assert "'os-envv': no Env with that name" in p.message and "os-env" in (p.hint or "")
    with pytest.raises((PlanError, DefinitionError)) as e:
        snapshot(_tree(tmp_path, dockerfile="FROM envbuild.invalid/env/os\n"))
    assert "'os' is a Base, not an Env" in e.value.problems[0].message


def test_a_cycle_through_the_dockerfile_is_refused(tmp_path):
    with pytest.raises((PlanError, DefinitionError)) as e:
        snapshot(_tree(tmp_path, env_base="dock"))
    assert any("cycle of definitions" in p.message and "dock" in p.message
               and "os-env" in p.message for p in e.value.problems)


def test_a_tag_on_the_env_reference_and_a_foreign_tag_are_still_refused(tmp_path):
    with pytest.raises(SourceError) as e:
        snapshot(_tree(tmp_path, dockerfile="FROM envbuild.invalid/env/os-env:v1\n"))
    assert "\n" not in e.value.message and "envbuild.invalid/env/NAME" in e.value.message
    with pytest.raises(SourceError) as e:
        snapshot(_tree(tmp_path, dockerfile=textwrap.dedent("""\
            FROM envbuild.invalid/env/os-env AS os
            FROM debian:bookworm
            COPY --from=os / /
            """)))
    assert "FROM debian:bookworm names a tag, not a digest" in e.value.message


def test_a_dockerfile_outside_the_source_root_is_not_read_for_edges(tmp_path):
    """The loader locates the Dockerfile as pinning does: a context linked out of the
    repository is neither read for FROM lines nor pinned (one line)."""
    from envbuild.defs.load import collect_definitions

    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "Dockerfile").write_text("FROM envbuild.invalid/env/os-env\n")
    defs = _tree(tmp_path / "repo")
    ctx = defs / "base" / "ctx"
    (ctx / "Dockerfile").unlink()
    ctx.rmdir()
    ctx.symlink_to(outside)
    assert collect_definitions(defs).defs.by_name["dock"].source.envs == ()
    with pytest.raises(SourceError) as e:
        snapshot(defs)
    assert "outside the source root" in e.value.message and "\n" not in e.value.message
