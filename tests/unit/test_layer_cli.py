"""``envbuild layer pack|ls|cat|unpack|verify|stat`` in-process (no subprocess): a round trip
through a tmp store, ``-o`` files, digest prefixes, and every error as one line plus a hint."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from envbuild.cli.main import main
from tests.unit.test_layers_support import snapshot

MTIME = 1_600_000_000
BINARY = bytes(range(256)) * 300  # > 16 KiB: frames of its own with lazy framing


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(MTIME + 1))
    monkeypatch.delenv("ENVBUILD_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "etc" / "empty-dir").mkdir(parents=True)
    (src / "bin" / "tool").write_text("#!/bin/sh\necho tool\n")
    (src / "bin" / "tool").chmod(0o755)
    (src / "etc" / "os-release").write_text("ID=test\n")
    (src / "etc" / "empty").write_bytes(b"")
    (src / "data.bin").write_bytes(BINARY)
    os.symlink("../etc/os-release", src / "bin" / "release")
    os.link(src / "etc" / "os-release", src / "etc" / "os-release.hard")
    for dirpath, dirnames, filenames in os.walk(src):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (MTIME, MTIME), follow_symlinks=False)
    return tmp_path


def run(capsys, *argv):
    code = main(["--store", "store", *argv])
    out, err = capsys.readouterr()
    if isinstance(out, bytes):  # capsysbinary
        out, err = out.decode(errors="replace"), err.decode()
    assert "Traceback" not in err
    return code, out, err


def pack_json(capsys, *extra) -> dict:
    code, out, err = run(capsys, "layer", "pack", "src", "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def assert_error(code: int, err: str, *needles: str) -> None:
    """Exit 1, exactly one ``error:`` line and one ``hint:`` line, no traceback."""
    lines = err.strip().splitlines()
    assert code == 1, err
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    for n in needles:
        assert n in err, (n, err)


# -- the round trip -------------------------------------------------------------------------


def test_pack_ls_cat_unpack_verify_round_trip(env, capsysbinary):
    capsys = capsysbinary
    info = pack_json(capsys)
    digest = info["digest"]
    assert set(info) >= {"digest", "diff_id", "size", "uncompressed_size", "entries", "frames",
                         "toc_digest"}
    assert info["entries"] == 9 and info["store"] == "store" and info["output"] is None
    blob = env / "store" / "blobs" / "sha256" / digest[7:]
    assert "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest() == digest

    code, out, _ = run(capsys, "layer", "ls", digest)
    assert code == 0
    assert out.splitlines() == ["bin/", "bin/release", "bin/tool", "data.bin", "etc/",
                                "etc/empty", "etc/empty-dir/", "etc/os-release",
                                "etc/os-release.hard"]

    code, out, _ = run(capsys, "layer", "ls", "--long", digest)
    lines = {e: next(x for x in out.splitlines() if f" {e}" in x)
             for e in ("bin/", "bin/release", "bin/tool", "data.bin", "etc/os-release.hard")}
    assert lines["bin/tool"].startswith("-rwxr-xr-x ")
    assert lines["bin/release"].startswith("lrwxrwxrwx ")
    assert lines["bin/release"].endswith(" bin/release -> ../etc/os-release")
    assert lines["etc/os-release.hard"].startswith("hrw-r--r-- ")
    assert lines["etc/os-release.hard"].endswith(" etc/os-release.hard link to etc/os-release")
    assert lines["bin/"].startswith("drwxr-xr-x ") and " 2020-09-13 12:26 bin/" in lines["bin/"]
    assert f" {len(BINARY)} " in lines["data.bin"]

    assert main(["--store", "store", "layer", "cat", digest, "data.bin"]) == 0
    assert capsysbinary.readouterr().out == BINARY
    assert main(["--store", "store", "layer", "cat", digest[:19], "/etc/os-release.hard"]) == 0
    assert capsysbinary.readouterr().out == b"ID=test\n"

    code, _, err = run(capsys, "layer", "unpack", digest, "out")
    assert code == 0, err
    assert snapshot(env / "out") == snapshot(env / "src")

    code, out, _ = run(capsys, "layer", "verify", digest)
    assert code == 0 and out.strip().startswith(f"ok: {digest} (9 entries, ")


def test_pack_to_file_is_atomic_and_stores_nothing(env, capsys):
    code, out, err = run(capsys, "layer", "pack", "src", "-o", "layer.tzst")
    assert code == 0, err
    data = (env / "layer.tzst").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert out.splitlines()[0].split() == ["digest", digest]
    assert "written to" in out and "stored in" not in out
    assert sorted(os.listdir(env)) == ["layer.tzst", "src"]  # no temp file, no store created

    code, out, _ = run(capsys, "layer", "verify", "layer.tzst")
    assert code == 0 and out.startswith(f"ok: {digest} ")
    code, out, _ = run(capsys, "layer", "verify", "--json", "layer.tzst")
    doc = json.loads(out)
    assert doc["ok"] is True and doc["digest"] == digest


def test_pack_to_file_and_store_is_one_blob(env, capsys):
    info = pack_json(capsys, "-o", "l.tzst", "--store")
    assert info["output"] == "l.tzst" and info["store"] == "store"
    assert (env / "store" / "blobs" / "sha256" / info["digest"][7:]).read_bytes() == \
        (env / "l.tzst").read_bytes()


def test_pack_failure_leaves_no_output(env, capsys):
    (env / "old.tzst").write_bytes(b"previous")
    code, _, err = run(capsys, "layer", "pack", "missing", "-o", "old.tzst")
    assert_error(code, err, "pack missing: no such directory")
    assert (env / "old.tzst").read_bytes() == b"previous"
    assert sorted(os.listdir(env)) == ["old.tzst", "src"]


def test_pack_is_deterministic_and_honours_source_date_epoch(env, capsys, monkeypatch):
    first = pack_json(capsys, "-o", "a")
    assert pack_json(capsys, "-o", "b")["digest"] == first["digest"]
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1000")
    clamped = pack_json(capsys, "-o", "c")
    assert clamped["digest"] != first["digest"]
    code, out, _ = run(capsys, "layer", "ls", "--json", "c")
    doc = json.loads(out)
    assert doc["layer"] == "c" and {e["mtime"] for e in doc["entries"]} == {1000}
    assert all("chunks" not in e for e in doc["entries"])


def test_framing_option(env, capsys):
    assert pack_json(capsys, "-o", "c", "--framing", "compact")["framing"] == "compact"
    code, out, _ = run(capsys, "layer", "stat", "--json", "c")
    assert json.loads(out)["framing"] == "compact"


def test_stat_summary_and_entry(env, capsys):
    digest = pack_json(capsys)["digest"]
    code, out, _ = run(capsys, "layer", "stat", "--json", digest)
    doc = json.loads(out)
    assert code == 0 and doc["entries"] == 9 and doc["framing"] == "lazy"
    assert doc["types"] == {"dir": 3, "file": 4, "hardlink": 1, "symlink": 1}
    assert doc["toc_size"] > 0 and doc["frames"] >= 2

    code, out, _ = run(capsys, "layer", "stat", digest)
    assert code == 0 and "toc_digest" in out and "4 file" in out

    code, out, _ = run(capsys, "layer", "stat", "--json", digest, "data.bin")
    entry = json.loads(out)
    assert entry["size"] == len(BINARY) and entry["chunks"]
    assert entry["digest"] == "sha256:" + hashlib.sha256(BINARY).hexdigest()
    code, out, _ = run(capsys, "layer", "stat", digest, "data.bin")
    assert code == 0 and "uoffset" in out and "0644" in out


# -- naming layers by digest ----------------------------------------------------------------


def test_digest_prefix_forms(env, capsys):
    digest = pack_json(capsys)["digest"]
    for ref in (digest, digest[7:], digest[:7 + 12], digest[7:7 + 12], digest.upper()[7:]):
        code, out, err = run(capsys, "layer", "ls", ref)
        assert code == 0 and "bin/tool" in out, (ref, err)


def test_ambiguous_prefix(env, capsys):
    pack_json(capsys)
    blobs = env / "store" / "blobs" / "sha256"
    prefix = "ab" * 6
    for tail in ("0" * 52, "1" * 52):
        (blobs / (prefix + tail)).write_bytes(b"x")
    code, _, err = run(capsys, "layer", "ls", prefix)
    assert_error(code, err, "ambiguous", "2 blobs match", "more hex digits")


@pytest.mark.parametrize("ref, needle", [
    ("sha256:" + "0" * 64, "not in the store"),
    ("0123456789ab", "no blob in the store"),
    ("0123abc", "too few for a digest prefix"),
    ("sha256:xyz", "invalid digest"),
    ("sha256:0123", "too short"),
    ("no-such-file", "no such layer file"),
])
def test_unknown_layer_references(env, capsys, ref, needle):
    pack_json(capsys)
    code, _, err = run(capsys, "layer", "ls", ref)
    assert_error(code, err, needle)


def test_digest_without_a_store_does_not_create_one(env, capsys):
    code, _, err = run(capsys, "layer", "ls", "0123456789abcdef")
    assert_error(code, err, "there is no store at store")
    assert not (env / "store").exists()


# -- inputs that are not layers -------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "verify", "stat"])
@pytest.mark.parametrize("content, needle", [
    (b"", "too short for a footer"),
    (os.urandom(4096), "no envbuild layer footer"),
    (b"\x28\xb5\x2f\xfd" + b"\0" * 200, "no envbuild layer footer"),
])
def test_files_that_are_not_layers(env, capsys, command, content, needle):
    (env / "bad").write_bytes(content)
    code, _, err = run(capsys, "layer", command, "bad")
    assert_error(code, err, needle, "not an envbuild layer")


def test_directory_as_layer(env, capsys):
    code, _, err = run(capsys, "layer", "ls", "src")
    assert_error(code, err, "src is a directory", "envbuild layer pack src")


def test_fifo_and_dangling_symlink_as_layer(env, capsys):
    os.mkfifo(env / "fifo")
    os.symlink("nowhere", env / "dangling")
    for ref in ("fifo", "dangling"):
        code, _, err = run(capsys, "layer", "ls", ref)
        assert_error(code, err, f"{ref} is not a regular file")


def test_truncated_layer_file(env, capsys):
    pack_json(capsys, "-o", "l")
    data = (env / "l").read_bytes()
    (env / "l").write_bytes(data[:-1])
    code, _, err = run(capsys, "layer", "verify", "l")
    assert_error(code, err, "layer l:")


def test_corrupt_stored_blob(env, capsys):
    digest = pack_json(capsys)["digest"]
    blob = env / "store" / "blobs" / "sha256" / digest[7:]
    data = bytearray(blob.read_bytes())
    entry = json.loads(run(capsys, "layer", "stat", "--json", digest, "data.bin")[1])
    chunk = entry["chunks"][0]
    data[chunk["offset"] + chunk["csize"] // 2] ^= 0xFF  # inside data.bin's own frame
    blob.write_bytes(bytes(data))
    code, _, err = run(capsys, "layer", "verify", digest)
    assert_error(code, err, f"layer {digest}", "stored blob is damaged")
    code, _, err = run(capsys, "layer", "cat", digest, "data.bin")
    assert_error(code, err, f"layer {digest}", "stored blob is damaged")
    code, out, err = run(capsys, "layer", "cat", digest, "etc/os-release")  # other frames
    assert code == 0 and out == "ID=test\n", err


# -- cat and unpack errors ------------------------------------------------------------------


@pytest.mark.parametrize("path, needles", [
    ("etc", ("etc is a directory", "envbuild layer ls")),
    ("etc/os-relaese", ("no member 'etc/os-relaese'", "did you mean 'etc/os-release'?")),
    ("zzzzzzzzz", ("no member", "envbuild layer ls")),
    ("bin/release", ("symlink to '../etc/os-release'", "cat the path it points to")),
])
def test_cat_errors(env, capsys, path, needles):
    pack_json(capsys, "-o", "l")
    code, _, err = run(capsys, "layer", "cat", "l", path)
    assert_error(code, err, *needles)


def test_unpack_stacks_onto_an_existing_tree(env, capsys):
    pack_json(capsys, "-o", "l")
    (env / "out" / "etc").mkdir(parents=True)
    (env / "out" / "etc" / "keep").write_text("lower\n")
    (env / "out" / "etc" / "os-release").write_text("ID=old\n")
    code, _, err = run(capsys, "layer", "unpack", "l", "out")
    assert code == 0, err
    assert (env / "out" / "etc" / "keep").read_text() == "lower\n"
    assert (env / "out" / "etc" / "os-release").read_text() == "ID=test\n"


def test_unpack_whiteouts(env, capsys):
    (env / "src" / "etc" / ".wh.keep").write_bytes(b"")
    pack_json(capsys, "-o", "l")
    (env / "out" / "etc").mkdir(parents=True)
    (env / "out" / "etc" / "keep").write_text("lower\n")
    assert run(capsys, "layer", "unpack", "l", "out")[0] == 0
    assert not (env / "out" / "etc" / "keep").exists()
    assert not (env / "out" / "etc" / ".wh.keep").exists()
    assert run(capsys, "layer", "unpack", "--whiteouts", "keep", "l", "kept")[0] == 0
    assert (env / "kept" / "etc" / ".wh.keep").exists()


def test_unpack_json_reports_the_layer_dest_and_members(env, capsys):
    """``layer unpack --json``: one document on stdout (issue 38: every command that reports
    takes --json), nothing on stderr."""
    digest = pack_json(capsys)["digest"]
    code, out, err = run(capsys, "layer", "unpack", "--json", digest[:19], "out")
    assert code == 0, err
    assert json.loads(out) == {"layer": digest, "dest": "out", "entries": 9,
                               "whiteouts": "apply"}
    assert err == ""
    assert snapshot(env / "out") == snapshot(env / "src")


def test_an_unknown_prefix_names_the_store_by_its_url(env, capsys):
    pack_json(capsys)
    code, _, err = run(capsys, "layer", "ls", "0123456789ab")
    assert_error(code, err, "no blob in the store store starts with 0123456789ab")


def test_unpack_into_a_file(env, capsys):
    pack_json(capsys, "-o", "l")
    (env / "file").write_text("x")
    code, _, err = run(capsys, "layer", "unpack", "l", "file")
    assert_error(code, err, "file exists and is not a directory")


def test_pack_output_errors(env, capsys):
    code, _, err = run(capsys, "layer", "pack", "src", "-o", "src")
    assert_error(code, err, "it is a directory")
    code, _, err = run(capsys, "layer", "pack", "src", "-o", "nodir/x")
    assert_error(code, err, "write layer nodir/x")
    (env / "f").write_text("x")
    code, _, err = run(capsys, "layer", "pack", "f", "-o", "x")
    assert_error(code, err, "pack f: not a directory")


def test_help_documents_layer_references_and_stacking(env, capsys):
    assert main(["layer", "unpack", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "stacked onto it" in out and "12 hex digits" in out


def test_damaged_layers_never_crash(env, capsysbinary):
    """Bit flips and truncations anywhere in the blob (data frames, TOC, footer): every command
    exits 0 or 1, and a failure is one error line with a hint, never a traceback."""
    capsys = capsysbinary
    pack_json(capsys, "-o", "good")
    data = (env / "good").read_bytes()
    positions = list(range(0, len(data), max(1, len(data) // 25))) + \
        list(range(len(data) - 120, len(data), 7))
    for i, pos in enumerate(positions):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        (env / "bad").write_bytes(bytes(bad[:pos + 1] if i % 5 == 4 else bad))
        for cmd in (["ls", "-l"], ["verify"], ["stat"]):
            code, _, err = run(capsys, "layer", *cmd, "bad")
            if code:
                assert_error(code, err, "layer bad:")
        code, out, _ = run(capsys, "layer", "verify", "bad")
        # Some bits of a zstd bitstream do not change the output: such a blob is a different,
        # valid layer (a store blob would fail its digest; a file reports its new sha256).
        original = "sha256:" + hashlib.sha256(data).hexdigest()
        assert code == 1 or (original not in out and "ok: sha256:" in out), pos
        for path in ("data.bin", "etc/os-release"):
            code, _, err = run(capsys, "layer", "cat", "bad", path)
            if code:
                assert_error(code, err)


def test_index_stores_a_layers_import_index_and_pack_store_writes_one(env, capsys):
    """``layer pack --store`` indexes the pycs it stores; ``layer index LAYER`` (re)builds the
    record of a stored layer (an older envbuild's); a layer without pycs says so; no layer
    named, a layer file and an unknown digest are one-line errors."""
    import py_compile
    import sys

    from envbuild.store import PYIMPORT_RECORDS, LocalStore

    mod = env / "src" / "lib" / "mod.py"
    mod.parent.mkdir()
    mod.write_text("import json\n")
    py_compile.compile(str(mod), str(mod.parent / "__pycache__" /
                                     f"mod.{sys.implementation.cache_tag}.pyc"), doraise=True)
    digest = pack_json(capsys)["digest"]
    store = LocalStore(env / "store")
    assert store.get_record(PYIMPORT_RECORDS, digest[7:])["layer"] == digest
    store.delete_record(PYIMPORT_RECORDS, digest[7:])
    code, out, err = run(capsys, "layer", "index", digest[:19])
    assert code == 0 and "1 pycs indexed" in out, err
    assert store.get_record(PYIMPORT_RECORDS, digest[7:])["pycs"]
    code, out, _ = run(capsys, "layer", "index", "--json", digest)
    assert json.loads(out)["layers"][0]["pycs"] == 1
    (env / "plain").mkdir()
    (env / "plain" / "f").write_text("x")
    code, out, err = run(capsys, "layer", "pack", "plain", "--json")
    plain = json.loads(out)["digest"]
    code, out, _ = run(capsys, "layer", "index", plain)
    assert code == 0 and "no pycs" in out
    assert_error(*run(capsys, "layer", "index")[::2], "no layer named")
    (env / "layer.file").write_bytes(b"x")
    assert_error(*run(capsys, "layer", "index", "layer.file")[::2], "no store record")
    assert_error(*run(capsys, "layer", "index", "sha256:" + "f" * 12)[::2], "no blob")
