"""``strip_components:`` of archive/git sources (the unpacker, the schema, the key) and
``check:`` entries with their own ``timeout:`` plus the runner-summary reader."""

from __future__ import annotations

import io
import tarfile
import textwrap
from pathlib import Path

import pytest

from envbuild.build.check import CheckResult, runner_summary
from envbuild.defs import load_definitions
from envbuild.defs.model import DEFAULT_CHECK_TIMEOUT, ArchiveSource, CheckCommand, GitSource
from envbuild.errors import DefinitionError, UnsafeLayerError
from envbuild.layers import MAX_STRIP_COMPONENTS, unpack_tar


def _tar(members) -> bytes:
    """members: (name, kind, payload-or-linkname) with kind file/dir/symlink/hardlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, extra in members:
            ti = tarfile.TarInfo(name)
            ti.mode = 0o755 if kind == "dir" else 0o644
            if kind == "file":
                ti.size = len(extra)
                tf.addfile(ti, io.BytesIO(extra))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                       "hardlink": tarfile.LNKTYPE}[kind]
            ti.linkname = extra or ""
            tf.addfile(ti)
    return buf.getvalue()


SDIST = [("pkg-1.0", "dir", None), ("pkg-1.0/setup.py", "file", b"setup"),
         ("pkg-1.0/src/pkg/__init__.py", "file", b"x = 1\n"),
         ("pkg-1.0/link", "symlink", "src/pkg"),
         ("pkg-1.0/hard", "hardlink", "pkg-1.0/setup.py")]


def _unpack(data: bytes, dest: Path, strip: int) -> None:
    dest.mkdir(exist_ok=True)
    unpack_tar(io.BytesIO(data), dest, name="archive t.tar", strip_components=strip)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_strip_one_puts_an_sdist_into_dest(tmp_path):
    _unpack(_tar(SDIST), tmp_path / "d", 1)
    assert _tree(tmp_path / "d") == ["hard", "link", "setup.py", "src", "src/pkg",
                                     "src/pkg/__init__.py"]
    assert (tmp_path / "d" / "hard").stat().st_ino == (tmp_path / "d" / "setup.py").stat().st_ino
    assert (tmp_path / "d" / "link").readlink() == Path("src/pkg")  # targets are not stripped


def test_strip_zero_keeps_the_top_directory(tmp_path):
    _unpack(_tar(SDIST), tmp_path / "d", 0)
    assert (tmp_path / "d" / "pkg-1.0" / "setup.py").read_bytes() == b"setup"


def test_strip_two_drops_the_directories_it_empties_but_refuses_to_lose_a_file(tmp_path):
    with pytest.raises(UnsafeLayerError, match="leaves nothing of file 'pkg-1.0/setup.py'"):
        _unpack(_tar(SDIST), tmp_path / "d", 2)
    only_deep = [m for m in SDIST if m[0].startswith("pkg-1.0/src") or m[1] == "dir"]
    _unpack(_tar(only_deep), tmp_path / "e", 2)
    assert _tree(tmp_path / "e") == ["pkg", "pkg/__init__.py"]


def test_a_strip_that_leaves_nothing_is_refused(tmp_path):
    with pytest.raises(UnsafeLayerError, match="leaves nothing of it"):
        _unpack(_tar([("a", "dir", None), ("a/b", "dir", None)]), tmp_path / "d", 2)


def test_a_hardlink_whose_target_is_stripped_away_is_refused(tmp_path):
    data = _tar([("top", "file", b"t"), ("d/x", "hardlink", "top")])
    with pytest.raises(UnsafeLayerError):  # "top" itself is refused first: nothing is lost
        _unpack(data, tmp_path / "d", 1)
    data = _tar([("d/top", "file", b"t"), ("d/x", "hardlink", "d")])
    with pytest.raises(UnsafeLayerError, match="strip_components 1 removes"):
        _unpack(data, tmp_path / "e", 1)


def test_dotdot_is_refused_even_in_the_stripped_part(tmp_path):
    # "../x" stripped by one would be "x": the whole name is checked before stripping.
    with pytest.raises(UnsafeLayerError, match="'..'"):
        _unpack(_tar([("../etc/passwd", "file", b"root")]), tmp_path / "d", 1)
    assert not (tmp_path / "etc").exists()


@pytest.mark.parametrize("bad", [-1, MAX_STRIP_COMPONENTS + 1, 10**9])
def test_the_unpacker_refuses_out_of_range_strips(tmp_path, bad):
    with pytest.raises(UnsafeLayerError, match="not within"):
        _unpack(_tar(SDIST), tmp_path / "d", bad)


HEADER = "apiVersion: envbuild/v1\nkind: Workspace\nname: w\nbuild_on: b\n"


def _load(tmp_path, body: str):
    d = tmp_path / "defs"
    d.mkdir(exist_ok=True)
    (d / "w.yaml").write_text(HEADER + textwrap.dedent(body))
    return load_definitions(str(d))


@pytest.mark.parametrize("value", ["-1", "17", "1000000000000", "1.5", "'1'", "true"])
def test_the_schema_refuses_hostile_strip_values(tmp_path, value):
    for src in (f"{{archive: {{path: a.tgz, sha256: '{'0' * 64}', strip_components: {value}}}}}",
                f"{{git: {{url: https://example.invalid/r.git, rev: main, "
                f"strip_components: {value}}}}}"):
        with pytest.raises(DefinitionError) as info:
            _load(tmp_path, f"source: {src}\n")
        assert any("strip_components" in p.render() for p in info.value.problems), \
            [p.render() for p in info.value.problems]


def test_strip_components_is_in_the_identity_only_when_set():
    sha = "0" * 64
    assert ArchiveSource("a", sha).identity() == {"archive": {"sha256": sha}}
    assert ArchiveSource("a", sha, 1).identity() == {"archive": {"sha256": sha,
                                                                 "strip_components": 1}}
    assert GitSource("u", "r").identity() == {"git": {"url": "u"}}
    assert GitSource("u", "r", 2).identity()["git"]["strip_components"] == 2


def test_check_entries_string_or_run_with_timeout(tmp_path):
    defs = _load(tmp_path, """\
        source: {archive: {path: a.tgz, sha256: '%s', strip_components: 1}}
        check:
          - python3 -V
          - {run: pytest -q, timeout: 900}
          - {run: "true"}
        """ % ("0" * 64))
    ws = defs.by_name["w"]
    assert ws.source.strip_components == 1
    assert ws.check == (CheckCommand("python3 -V", DEFAULT_CHECK_TIMEOUT),
                        CheckCommand("pytest -q", 900.0),
                        CheckCommand("true", DEFAULT_CHECK_TIMEOUT))


@pytest.mark.parametrize("entry", ["{run: x, timeout: 0}", "{run: x, timeout: -5}",
                                   "{run: x, timeout: 100000}", "{timeout: 5}",
                                   "{run: x, timeout: 5, extra: 1}", "{run: ''}"])
def test_bad_check_entries_are_refused(tmp_path, entry):
    with pytest.raises(DefinitionError):
        _load(tmp_path, f"source: {{path: .}}\ncheck:\n  - {entry}\n")


@pytest.mark.parametrize("output,summary", [
    ("....\n===== 1322 passed, 3 skipped in 9.10s =====\n", "1322 passed, 3 skipped in 9.10s"),
    ("F.\n= 1 failed, 2 passed in 0.3s =\n", "1 failed, 2 passed in 0.3s"),
    ("...\nRan 40 tests in 0.100s\n\nOK\n", "Ran 40 tests in 0.100s"),
    ("ok 1\n3 passed, 0 failed\n", "3 passed, 0 failed"),
    ("hello\n", None),
    ("", None),
])
def test_runner_summary(output, summary):
    assert runner_summary(output) == summary


def test_a_timed_out_check_is_a_failure_with_its_tail():
    out = "\n".join(f"line {i}" for i in range(50))
    r = CheckResult("e", "w", "sleep 9", 0, out, 1.0, timed_out=True, timeout=1.0)
    assert not r.ok
    assert r.tail == [f"line {i}" for i in range(30, 50)]


def test_a_subtree_with_the_marker_is_its_own_tree(tmp_path):
    from envbuild.defs.load import SEPARATE_TREE_MARKER

    doc = "apiVersion: envbuild/v1\nkind: Base\nname: {}\nabi: x\nfrom: {{scratch: {{}}}}\n"
    (tmp_path / "t" / "examples" / "own").mkdir(parents=True)
    (tmp_path / "t" / "a.yaml").write_text(doc.format("a"))
    (tmp_path / "t" / "examples" / "b.yaml").write_text(doc.format("b"))
    (tmp_path / "t" / "examples" / "own" / "a.yaml").write_text(doc.format("a"))  # same name
    (tmp_path / "t" / "examples" / "own" / SEPARATE_TREE_MARKER).write_text("")
    assert sorted(load_definitions(str(tmp_path / "t")).by_name) == ["a", "b"]
    assert sorted(load_definitions(str(tmp_path / "t" / "examples" / "own")).by_name) == ["a"]


def test_the_swe_example_is_a_tree_of_its_own_and_has_the_harness_shape():
    from envbuild.plan.graph import check_tree
    from tests.conftest import REPO

    main = load_definitions(str(REPO / "envdefs"))
    assert not any(n.startswith(("task-", "inst-", "env-", "swe-")) for n in main.by_name)
    graph = check_tree(REPO / "envdefs" / "examples" / "swe")
    # the task envs, plus swe-os: the OS env the Dockerfile base starts FROM
    envs = [e for e in graph.defs.envs if e.name.startswith("task-")]
    assert len(envs) == 6 and {e.name for e in graph.defs.envs} - {e.name for e in envs} == {
        "swe-os"}
    repos = {e.name.removeprefix("task-").rsplit("-", 1)[0] for e in envs}
    assert repos == {"more-itertools", "toolz", "idna"}
    for e in envs:
        rv = e.name.removeprefix("task-")
        assert graph.env_layers(e.name) == ("swe-base", f"inst-{rv}", f"env-{rv}", "agent")
        ws = graph[f"inst-{rv}"]
        assert ws.source.strip_components == 1 and ws.check[0].timeout == 600
