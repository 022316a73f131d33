"""The fast ``--changed-since`` path (REV read from git objects, keys reused from the working
tree, REV's sources pinned by git object id) gives exactly the keys of the full checkout of
REV, in a real git repository: edits, renames, deletions, new files, a changed source, an edit
of an upstream base, and a broken file at REV."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap

import pytest

from envbuild.build import gitrev
from envbuild.build.gitrev import keys_at_revision, keys_at_revision_checkout, plan_changes
from envbuild.build.pin import Pinner, snapshot
from envbuild.defs.parsecache import RACY_NS, ParseCache
from envbuild.errors import SourceError
from envbuild.plan.changes import diff_keys
from tests.conftest import require_tool

pytestmark = pytest.mark.integration

N_WS, N_TK, N_SRC = 30, 10, 4


def git(cwd, *argv):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


def write(root, rel, text):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(textwrap.dedent(text).lstrip())


def generate(root):
    """A small tree with every kind of dependency: a stacked base, abi and digest pins, path
    and copy sources shared by many definitions, envs of 1-2 toolkits."""
    write(root, "envdefs/base/b0.yaml", """
        apiVersion: envbuild/v1
        kind: Base
        name: b0
        abi: a0
        from: {debootstrap: {suite: bookworm}}
        steps:
          - run: apt-get install -y python3
        """)
    write(root, "envdefs/base/b1.yaml", """
        apiVersion: envbuild/v1
        kind: Base
        name: b1
        abi: a0
        from: {base: b0}
        steps:
          - run: apt-get install -y git
        """)
    for s in range(N_SRC):
        write(root, f"sources/s{s}/pkg/mod.py", f"x = {s}\n")
        write(root, f"sources/s{s}/run.sh", "#!/bin/sh\n")
        (root / f"sources/s{s}/run.sh").chmod(0o755)
    write(root, "envdefs/files/tool.cfg", "a = 1\n")
    for w in range(N_WS):
        pin = "pin: digest" if w % 3 == 0 else "pin: abi"
        write(root, f"envdefs/workspaces/ws{w:03d}.yaml", f"""
            apiVersion: envbuild/v1
            kind: Workspace
            name: ws{w:03d}
            build_on: b{w % 2}
            {pin}
            source: {{path: ../../sources/s{w % N_SRC}}}
            steps:
              - run: pip install -e /workspace  # {w}
            """)
    for t in range(N_TK):
        write(root, f"envdefs/toolkits/tk{t:03d}.yaml", f"""
            apiVersion: envbuild/v1
            kind: Toolkit
            name: tk{t:03d}
            build_on: b0
            prefix: /opt/toolkits/tk{t:03d}
            steps:
              - copy: {{src: ../files/tool.cfg, dest: /opt/toolkits/tk{t:03d}/tool.cfg}}
            config: {{env: {{PATH: '/opt/toolkits/tk{t:03d}/bin:$PATH'}}}}
            """)
    for e in range(N_WS):
        tks = ", ".join(f"tk{(e + i) % N_TK:03d}" for i in range(1 + e % 2))
        write(root, f"envdefs/envs/env{e:03d}.yaml", f"""
            apiVersion: envbuild/v1
            kind: Env
            name: env{e:03d}
            base: b{e % 2}
            workspace: ws{e:03d}
            toolkits: [{tks}]
            """)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    require_tool("git")
    root = tmp_path / "repo"
    generate(root)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "one")
    monkeypatch.chdir(root)
    return root


def as_dicts(keys):
    return (dict(keys.layers), {k: dict(v) for k, v in keys.inputs.items()},
            dict(keys.env_locks), {k: dict(v) for k, v in keys.env_inputs.items()})


@pytest.fixture
def delta_taken(monkeypatch):
    """Whether each ``_keys_from_delta`` call gave the keys (True) or deferred to loading REV
    whole (False): the tests below must exercise the path they claim to."""
    taken: list[bool] = []
    real = gitrev._keys_from_delta

    def spy(*args, **kwargs):
        keys = real(*args, **kwargs)
        taken.append(keys is not None)
        return keys

    monkeypatch.setattr(gitrev, "_keys_from_delta", spy)
    return taken


def assert_same_as_checkout(defs, rev, cache_dir):
    """Fast keys of ``rev`` (cold and warm parse cache, with and without the working tree's
    keys to reuse) == the full checkout's, and plan_changes agrees with the slow diff."""
    slow = keys_at_revision_checkout(defs, rev, Pinner())
    for _ in range(2):  # cold cache, then warm: blob ids, pins by object id, keys reused
        cache = ParseCache(cache_dir)
        cache.started_ns += 10 * RACY_NS  # a later run: file stats recorded and trusted
        pinner = Pinner()
        now = snapshot(defs, pinner, cache)
        fast = keys_at_revision(defs, rev, pinner, cache, now)
        assert as_dicts(fast) == as_dicts(slow)
        cache.save()
    assert as_dicts(keys_at_revision(defs, rev)) == as_dicts(slow)  # no cache at all
    _, changes = plan_changes(defs, None, rev, parse_cache=ParseCache(cache_dir))
    assert changes == diff_keys(slow, snapshot(defs).keys)
    return changes


def test_fast_path_matches_checkout_through_edits(repo, tmp_path, delta_taken):
    defs, cache_dir = repo / "envdefs", tmp_path / "node" / "parse"
    changes = assert_same_as_checkout(defs, "HEAD", cache_dir)
    assert changes.rebuild == () and changes.relock == ()

    # an edit, a rename, a deletion (an env), a new file, a changed source, a mode change
    ws = defs / "workspaces/ws004.yaml"
    ws.write_text(ws.read_text().replace("pip install", "pip install -q"))
    git(repo, "mv", "envdefs/toolkits/tk003.yaml", "envdefs/toolkits/renamed.yaml")
    git(repo, "rm", "-q", "envdefs/envs/env007.yaml")
    write(repo, "envdefs/toolkits/new.yaml", """
        apiVersion: envbuild/v1
        kind: Toolkit
        name: new
        build_on: b1
        prefix: /opt/toolkits/new
        """)
    (repo / "sources/s1/pkg/mod.py").write_text("x = 'changed'\n")
    (repo / "sources/s2/run.sh").chmod(0o644)
    env = defs / "envs/env008.yaml"  # an env edited in place, its layers unchanged
    env.write_text(env.read_text() + "config: {env: {X: '1'}}\n")
    changes = assert_same_as_checkout(defs, "HEAD", cache_dir)
    assert "ws004" in changes.rebuild and "new" in changes.rebuild
    assert "env008" in changes.relock
    assert "tk003" not in changes.rebuild  # renamed: same content, same key
    assert {f"ws{w:03d}" for w in range(1, N_WS, N_SRC)} <= set(changes.rebuild)  # s1 users
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "two")

    # an upstream base edit: b1 (stacked on b0) is re-keyed, and with it the pin: digest
    # workspaces on b1; abi-pinned ones keep their keys
    base = defs / "base/b0.yaml"
    base.write_text(base.read_text().replace("python3", "python3 curl"))
    changes = assert_same_as_checkout(defs, "HEAD", cache_dir)
    digest_on_b1 = {f"ws{w:03d}" for w in range(N_WS) if w % 3 == 0 and w % 2 == 1}
    assert {"b0", "b1"} | digest_on_b1 <= set(changes.rebuild)
    assert "ws002" not in changes.rebuild  # pin: abi on b0
    assert "ws001" not in changes.rebuild  # pin: abi on b1
    # against the first commit, two commits of changes at once
    assert_same_as_checkout(defs, "HEAD~1", cache_dir)
    assert delta_taken and all(delta_taken)  # REV as a delta of the working tree each time


def test_broken_file_at_rev_reported_as_the_checkout_reports_it(repo, tmp_path):
    bad = repo / "envdefs/workspaces/ws010.yaml"
    bad.write_text(bad.read_text().replace("build_on: b0", "build_on: [b0"))
    git(repo, "commit", "-q", "-a", "-m", "broken")
    bad.write_text(bad.read_text().replace("build_on: [b0", "build_on: b0"))  # fixed now
    defs = repo / "envdefs"
    with pytest.raises(SourceError) as slow:
        keys_at_revision_checkout(defs, "HEAD", Pinner())
    for _ in range(2):
        cache = ParseCache(tmp_path / "parse")
        now = snapshot(defs, Pinner(), cache)
        with pytest.raises(SourceError) as fast:
            keys_at_revision(defs, "HEAD", Pinner(), cache, now)
        assert fast.value.render_lines() == slow.value.render_lines()
        assert "HEAD:envdefs/workspaces/ws010.yaml" in "\n".join(fast.value.render_lines())
        cache.save()


def test_missing_source_at_rev_falls_back_to_the_checkout(repo, tmp_path):
    """A path git cannot name at REV (here: deleted) takes the full checkout, which reports it
    exactly as before."""
    git(repo, "rm", "-rq", "sources/s3")
    git(repo, "commit", "-q", "-m", "no s3")
    write(repo, "sources/s3/pkg/mod.py", "x = 3\n")
    defs = repo / "envdefs"
    with pytest.raises(SourceError) as slow:
        keys_at_revision_checkout(defs, "HEAD", Pinner())
    with pytest.raises(SourceError) as fast:
        keys_at_revision(defs, "HEAD", Pinner(), ParseCache(tmp_path / "parse"))
    assert fast.value.render_lines() == slow.value.render_lines()


def test_symlinked_source_dir_at_rev_matches_checkout(repo, tmp_path):
    os.symlink("s0", repo / "sources/link")
    ws = repo / "envdefs/workspaces/ws005.yaml"
    ws.write_text(ws.read_text().replace("sources/s1", "sources/link"))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "link")
    assert_same_as_checkout(repo / "envdefs", "HEAD", tmp_path / "parse")


BROKEN_AT_REV = {
    # name: (file, text at REV replaced, by), the working tree keeps the valid text
    "missing base": ("envdefs/base/b1.yaml", "name: b1", "name: b1-old"),
    "wrong kind": ("envdefs/workspaces/ws001.yaml", "build_on: b1", "build_on: tk001"),
    "cycle": ("envdefs/base/b0.yaml", "from: {debootstrap: {suite: bookworm}}",
              "from: {base: b1}"),
    "duplicate": ("envdefs/toolkits/tk002.yaml", "name: tk002", "name: tk001"),
    "abi": ("envdefs/base/b0.yaml", "abi: a0", "abi: a9"),
    "prefix overlap": ("envdefs/toolkits/tk001.yaml", "prefix: /opt/toolkits/tk001",
                       "prefix: /opt/toolkits/tk002/sub"),
    "unparsable": ("envdefs/envs/env003.yaml", "base: b1", "base: [b1"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_AT_REV))
def test_a_problem_only_at_rev_is_reported_as_the_checkout_reports_it(repo, tmp_path, case,
                                                                      delta_taken):
    """REV's graph is checked only where it can differ from the working tree's: a problem
    there (in a changed file, or in an unchanged one a change breaks) is never missed, and it
    is reported with the full check's words."""
    rel, old, new = BROKEN_AT_REV[case]
    if case == "abi":  # every workspace on b0 requires a0: the unchanged ones break at REV
        for w in range(0, N_WS, 2):
            f = repo / f"envdefs/workspaces/ws{w:03d}.yaml"
            f.write_text(f.read_text().replace("build_on: b0", "build_on: b0\nrequires: {abi: [a0]}"))
        git(repo, "commit", "-q", "-a", "-m", "requires a0")
    f = repo / rel
    valid = f.read_text()
    assert old in valid
    f.write_text(valid.replace(old, new))
    git(repo, "commit", "-q", "-a", "-m", f"broken: {case}")
    f.write_text(valid)
    defs = repo / "envdefs"
    with pytest.raises(SourceError) as slow:
        keys_at_revision_checkout(defs, "HEAD", Pinner())
    for _ in range(2):
        cache = ParseCache(tmp_path / "parse")
        pinner = Pinner()
        now = snapshot(defs, pinner, cache)
        with pytest.raises(SourceError) as fast:
            keys_at_revision(defs, "HEAD", pinner, cache, now)
        assert fast.value.render_lines() == slow.value.render_lines()
        cache.save(force=True)
    assert delta_taken == [False, False]  # the delta saw the problem and deferred


def test_a_damaged_cache_never_changes_the_plan(repo, tmp_path):
    """A corrupt or truncated parse cache between two runs is detected and rebuilt: the
    changes are the full checkout's."""
    defs, cache_dir = repo / "envdefs", tmp_path / "node" / "parse"
    ws = defs / "workspaces/ws004.yaml"
    ws.write_text(ws.read_text().replace("pip install", "pip install -q"))
    want = diff_keys(keys_at_revision_checkout(defs, "HEAD", Pinner()), snapshot(defs).keys)
    cache = ParseCache(cache_dir)
    cache.started_ns += 10 * RACY_NS
    assert plan_changes(defs, None, "HEAD", parse_cache=cache)[1] == want
    data = cache.path.read_bytes()
    assert b"pip install -e /workspace" in data  # one shared step (the cache interns parts)
    # the unchanged workspaces' command and a remembered key flipped: used, they would give
    # ws010 another key, to rebuild
    key = snapshot(defs).keys.layers["ws010"].encode()
    assert key in data
    flipped = data.replace(b"pip install -e", b"pip install -X").replace(
        key, key[:-1] + (b"0" if key[-1:] != b"0" else b"1"))
    for damaged in (flipped, data[: len(data) // 2]):
        cache.path.write_bytes(damaged)
        again = ParseCache(cache_dir)
        again.started_ns += 10 * RACY_NS
        plan, changes = plan_changes(defs, None, "HEAD", parse_cache=again)
        assert changes == want and dict(plan.keys.layers) == dict(snapshot(defs).keys.layers)
        assert again.rejected is not None
        assert ParseCache(cache_dir)._load() and ParseCache(cache_dir).rejected is None


def _random_edit(repo, rng, n):
    """One edit that keeps the tree valid (so REV stays a delta): a step, a build_on, a pin
    mode, a source, a toolkit prefix or config, an env's config, toolkits or workspace, a base
    step, a renamed file, a changed source file."""
    defs = repo / "envdefs"
    kind = rng.choice(["ws-run", "ws-base", "ws-pin", "ws-src", "tk-prefix", "tk-config",
                       "env-config", "env-tks", "env-ws", "base-step", "rename", "source"])
    if kind.startswith("ws") or kind.startswith("env"):
        files = sorted((defs / ("workspaces" if kind.startswith("ws") else "envs")).glob("*.yaml"))
    elif kind.startswith("tk"):
        files = sorted((defs / "toolkits").glob("*.yaml"))
    else:
        files = sorted((defs / "base").glob("*.yaml"))
    f = rng.choice(files)
    text = f.read_text()
    if kind == "ws-run":
        text = text.replace("pip install", f"pip install -v{n}", 1)
    elif kind == "ws-base":
        text = text.replace("build_on: b0", "build_on: bX").replace(
            "build_on: b1", "build_on: b0").replace("build_on: bX", "build_on: b1")
    elif kind == "ws-pin":
        text = text.replace("pin: abi", "pin: pX").replace(
            "pin: digest", "pin: abi").replace("pin: pX", "pin: digest")
    elif kind == "ws-src":
        text = re.sub(r"sources/s\d", f"sources/s{rng.randrange(N_SRC)}", text)
    elif kind == "tk-prefix":
        text = text.replace("/opt/toolkits/", f"/opt/toolkits/v{n}-")
    elif kind == "tk-config":
        text = text.replace("/bin:$PATH", f"/bin{n}:$PATH")
    elif kind == "env-config":
        text += f"config: {{env: {{N: '{n}'}}}}\n" if "config:" not in text else ""
        text = text.replace("N: '", f"N: '{n}", 1)
    elif kind == "env-tks":
        pick = rng.sample(range(N_TK), 2)
        text = re.sub(r"toolkits: \[[^]]*\]", f"toolkits: [tk{pick[0]:03d}, tk{pick[1]:03d}]", text)
    elif kind == "env-ws":
        text = re.sub(r"workspace: ws\d+", f"workspace: ws{rng.randrange(N_WS):03d}", text)
    elif kind == "base-step":
        text = text.replace("apt-get install -y", f"apt-get install -y x{n}", 1)
    if kind == "rename":
        f.rename(f.with_name(f"moved{n}-{f.name}"))
        return
    if kind == "source":
        (repo / f"sources/s{rng.randrange(N_SRC)}/pkg/mod.py").write_text(f"x = {n}\n")
        return
    f.write_text(text)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_edits_give_the_checkouts_keys(repo, tmp_path, seed, delta_taken):
    """Rounds of random valid edits, against one and two commits back: the delta's keys are
    the full checkout's every time."""
    import random

    rng = random.Random(seed)
    defs, cache_dir = repo / "envdefs", tmp_path / "node" / "parse"
    n = 0
    for round_ in range(3):
        for _ in range(rng.randrange(1, 6)):
            n += 1
            _random_edit(repo, rng, n)
        assert_same_as_checkout(defs, "HEAD", cache_dir)
        if round_:
            assert_same_as_checkout(defs, "HEAD~1", cache_dir)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"round {round_}")
    assert delta_taken and all(delta_taken)
