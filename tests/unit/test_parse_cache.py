"""The parse cache (envbuild.defs.parsecache): a tree is re-parsed only where it changed, the
result is the same as a full parse, and problems are always found by a real parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from envbuild.defs.load import collect_definitions
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import DefinitionError


def _tree(root: Path, n: int) -> Path:
    defs = root / "envdefs"
    (defs / "base").mkdir(parents=True)
    (defs / "base" / "b.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Base\nname: b\nabi: x\nfrom: {scratch: {}}\n")
    (defs / "workspaces").mkdir()
    for i in range(n):
        (defs / "workspaces" / f"w{i}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Workspace\nname: w{i}\nbuild_on: b\n"
            f"source: {{path: src{i}}}\nsteps:\n  - run: echo {i}\n")
    return defs


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name]
        assert a[name].origin.file == b[name].origin.file
        assert a[name].origin.field_positions == b[name].origin.field_positions


def test_only_changed_files_are_parsed_and_the_result_is_a_full_parse(tmp_path):
    defs = _tree(tmp_path, 20)
    cache = ParseCache(tmp_path / "cache")
    first = collect_definitions(defs, cache)
    assert (cache.hits, cache.misses) == (0, 21)
    cache.save()
    (defs / "workspaces" / "w3.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Workspace\nname: w3\nbuild_on: b\n"
        "source: {path: src3}\nsteps:\n  - run: echo changed\n")
    cache = ParseCache(tmp_path / "cache")  # a new process
    again = collect_definitions(defs, cache)
    assert (cache.hits, cache.misses) == (20, 1)
    _same(again.defs.by_name, collect_definitions(defs).defs.by_name)
    assert again.defs.by_name["w3"].steps[0].run == "echo changed"
    assert first.defs.by_name["w3"].steps[0].run == "echo 3"


def test_a_hit_is_placed_where_the_file_is_now(tmp_path):
    """The tree at a git revision is checked out elsewhere: same bytes, other path."""
    a = _tree(tmp_path / "a", 3)
    b = _tree(tmp_path / "b", 3)
    cache = ParseCache(tmp_path / "cache")
    collect_definitions(a, cache)
    got = collect_definitions(b, cache).defs.by_name
    assert cache.hits == 4
    _same(got, collect_definitions(b).defs.by_name)
    assert got["w1"].origin.directory == b / "workspaces"


def test_files_with_problems_are_never_cached(tmp_path):
    defs = _tree(tmp_path, 2)
    (defs / "workspaces" / "bad.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Workspace\nname: bad\nbuild_on: b\nsorce: {}\n")
    for _ in range(2):
        cache = ParseCache(tmp_path / "cache")
        result = collect_definitions(defs, cache)
        assert result.problems and "bad.yaml" in result.problems[0].file
        assert cache.misses == 1 or cache.hits == 0
        cache.save()
    with pytest.raises(DefinitionError):
        from envbuild.defs.load import load_definitions

        load_definitions(defs)


def test_a_corrupt_or_foreign_cache_file_is_empty(tmp_path):
    defs = _tree(tmp_path, 2)
    (tmp_path / "cache").mkdir()
    ParseCache(tmp_path / "cache").path.write_bytes(b"\x80\x05not a pickle")
    cache = ParseCache(tmp_path / "cache")
    assert len(collect_definitions(defs, cache).defs.by_name) == 3
    assert cache.hits == 0
    cache.save()
    assert ParseCache(tmp_path / "cache")._load()  # rewritten, readable


def test_git_blob_id_is_what_git_computes():
    from envbuild.defs.parsecache import git_blob_id

    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"  # git hash-object
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


def test_blob_ids_and_placed_copies_survive_a_save(tmp_path):
    from envbuild.defs.parsecache import git_blob_id

    defs = _tree(tmp_path, 3)
    cache = ParseCache(tmp_path / "cache")
    collect_definitions(defs, cache)
    data = (defs / "workspaces" / "w1.yaml").read_bytes()
    digest = cache.blob(git_blob_id(data))
    assert digest is not None and cache.blob("0" * 40) is None
    cache.save()
    again = ParseCache(tmp_path / "cache")
    assert again.blob(git_blob_id(data)) == digest
    placed = again.get(digest, "elsewhere/w1.yaml")
    assert placed is not None and placed[0].origin.file == "elsewhere/w1.yaml"
    here = again.get(digest, str(defs / "workspaces" / "w1.yaml"))
    assert here is not None
    # a copy placed at another file has the same original as the definition itself
    assert again.original(placed[0]) is again.original(here[0])
    other = again.get(cache.blob(git_blob_id((defs / "workspaces" / "w2.yaml").read_bytes())),
                      "elsewhere/w2.yaml")
    assert again.original(other[0]) is not again.original(placed[0])


def test_a_few_new_entries_are_not_worth_a_rewrite(tmp_path):
    defs = _tree(tmp_path, 5)
    cache = ParseCache(tmp_path / "cache")
    collect_definitions(defs, cache)
    cache.save()
    written = cache.path.stat().st_mtime_ns
    (defs / "workspaces" / "w1.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Workspace\nname: w1\nbuild_on: b\n"
        "source: {path: src1}\nsteps:\n  - run: echo changed\n")
    cache = ParseCache(tmp_path / "cache")
    collect_definitions(defs, cache)
    cache.save()
    assert cache.path.stat().st_mtime_ns == written  # one new entry: left for next time
    cache.save(force=True)
    again = ParseCache(tmp_path / "cache")
    collect_definitions(defs, again)
    assert again.misses == 0


def _later_run(directory) -> ParseCache:
    """A cache of a run that starts well after the files were written: their stats are old
    enough to be recorded (``RACY_NS``)."""
    from envbuild.defs.parsecache import RACY_NS

    cache = ParseCache(directory)
    cache.started_ns += 2 * RACY_NS
    return cache


def test_a_file_whose_stat_is_unchanged_is_not_read_again(tmp_path, monkeypatch):
    defs = _tree(tmp_path, 3)
    cache = _later_run(tmp_path / "cache")
    collect_definitions(defs, cache)
    cache.save(force=True)
    import builtins

    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    again = _later_run(tmp_path / "cache")
    got = collect_definitions(defs, again)
    monkeypatch.undo()
    assert not [f for f in opened if f.endswith(".yaml")]
    _same(got.defs.by_name, collect_definitions(defs).defs.by_name)
    assert again.blob(git_blob_id_of(defs / "workspaces" / "w1.yaml")) is not None


def git_blob_id_of(path):
    from envbuild.defs.parsecache import git_blob_id

    return git_blob_id(path.read_bytes())


def test_same_size_edit_with_the_old_mtime_is_still_read(tmp_path):
    """An edit that keeps the size and puts the mtime back (``touch -r``, ``cp -p``) changes
    the ctime: the file is read again and its new content used."""
    import os

    defs = _tree(tmp_path, 3)
    f = defs / "workspaces" / "w1.yaml"
    cache = _later_run(tmp_path / "cache")
    collect_definitions(defs, cache)
    cache.save(force=True)
    st = f.stat()
    f.write_text(f.read_text().replace("echo 1", "echo 7"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    again = _later_run(tmp_path / "cache")
    assert collect_definitions(defs, again).defs.by_name["w1"].steps[0].run == "echo 7"


def test_a_stat_too_close_to_the_run_is_never_recorded(tmp_path):
    defs = _tree(tmp_path, 2)
    cache = ParseCache(tmp_path / "cache")  # files written just now: racily clean
    collect_definitions(defs, cache)
    cache.save(force=True)
    again = ParseCache(tmp_path / "cache")
    f = str(defs / "workspaces" / "w1.yaml")
    assert again.file_digest(f, (defs / "workspaces" / "w1.yaml").stat()) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "code", "empty"])
def test_a_damaged_cache_file_is_detected_and_ignored(tmp_path, damage):
    """A truncated or corrupt cache file (a bit flip in a definition's ``run``) is never used:
    the tree is parsed again, and the result is the full parse's."""
    defs = _tree(tmp_path, 4)
    cache = _later_run(tmp_path / "cache")
    collect_definitions(defs, cache)
    cache.save(force=True)
    data = cache.path.read_bytes()
    if damage == "flip":
        at = data.rindex(b"echo 2")
        data = data[:at] + b"echo 3" + data[at + 6:]
    elif damage == "truncate":
        data = data[: len(data) * 2 // 3]
    elif damage == "header":
        data = b"x" + data
    elif damage == "code":
        data = data.replace(cache.code.encode(), b"0" * len(cache.code), 1)
    else:
        data = b""
    cache.path.write_bytes(data)
    again = _later_run(tmp_path / "cache")
    got = collect_definitions(defs, again)
    assert again.hits == 0 and again.misses == 5
    assert again.rejected is not None
    assert got.defs.by_name["w2"].steps[0].run == "echo 2"
    _same(got.defs.by_name, collect_definitions(defs).defs.by_name)
    again.save()
    fixed = _later_run(tmp_path / "cache")
    collect_definitions(defs, fixed)
    assert fixed.rejected is None and fixed.misses == 0  # rewritten, readable


def test_positions_survive_the_packed_format(tmp_path):
    defs = _tree(tmp_path, 2)
    cache = ParseCache(tmp_path / "cache")
    first = collect_definitions(defs, cache).defs.by_name
    cache.save(force=True)
    again = ParseCache(tmp_path / "cache")
    got = collect_definitions(defs, again).defs.by_name
    assert again.hits == 3
    for name in first:
        assert dict(got[name].origin.field_positions) == dict(first[name].origin.field_positions)
        assert got[name].origin.position("build_on") == first[name].origin.position("build_on")


def test_remembered_keys_are_the_computed_keys(tmp_path):
    """Keys looked up by their inputs (content, pins, upstreams) equal computed ones, also
    after an edit of a base that workspaces pin by digest, and their inputs are computed when
    read."""
    from envbuild.plan.graph import build_graph
    from envbuild.plan.keys import LazyInputs, compute_keys

    defs = _tree(tmp_path, 4)
    (defs / "workspaces" / "w3.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Workspace\nname: w3\nbuild_on: b\npin: digest\n"
        "source: {path: src3}\nsteps:\n  - run: echo 3\n")
    (defs / "envs").mkdir()
    (defs / "envs" / "e.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Env\nname: e\nbase: b\nworkspace: w3\n")

    def keyed(cache):
        graph = build_graph(collect_definitions(defs, cache).defs)
        pins = {d.name: {"source": "sha256:" + "0" * 64} for d in graph.defs.layers
                if d.kind == "Workspace"}
        return compute_keys(graph, pins, memo=cache), compute_keys(graph, pins)

    for edit in (None, "echo base", None):
        if edit:
            (defs / "base" / "b.yaml").write_text(
                "apiVersion: envbuild/v1\nkind: Base\nname: b\nabi: x\nfrom: {scratch: {}}\n"
                f"steps:\n  - run: {edit}\n")
        cache = ParseCache(tmp_path / "cache")
        memo, plain = keyed(cache)
        assert dict(memo.layers) == dict(plain.layers)
        assert dict(memo.env_locks) == dict(plain.env_locks)
        assert {k: dict(v) for k, v in memo.inputs.items()} == dict(plain.inputs)
        assert dict(memo.env_inputs) == dict(plain.env_inputs)
        cache.save(force=True)
    assert isinstance(memo.inputs, LazyInputs)  # the last run looked every key up
