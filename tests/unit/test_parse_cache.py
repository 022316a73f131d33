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
