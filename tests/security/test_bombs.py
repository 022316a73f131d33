"""Resource bombs (issue 11, item 9): hostile inputs that are small on disk and huge in memory,
time or disk once expanded. Each runs the real CLI in a subprocess (so a bomb cannot take the
test process down) under ``RLIMIT_AS`` with its peak RSS measured from ``os.wait4``, and must
end in one ``error:`` line, exit 1, no traceback, bounded memory and time.

- a TOC bomb: a 5 MB layer blob whose TOC inflates to ~620 MB of JSON (``layer ls/verify/
  unpack``), with an honest footer and with a footer that under-declares the TOC;
- a frame bomb: a data frame that inflates to 3 GiB where the TOC says 1 MiB (``layer verify/
  unpack/cat``), with and without a content size in the frame header;
- a YAML alias bomb (billion laughs) through ``envbuild validate`` and a JobManifest through
  ``envbuild job resolve``;
- sparse files in a real sandbox: ``pack_diff`` refuses a snapshot whose apparent size is over
  the policy cap, and reports sparse files it packs.

The layers are made by the real writer and then changed by byte surgery (new frames, a new TOC
and footer), as ``tests/unit/test_layers_corrupt.py`` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from envbuild.layers import FOOTER_SIZE, SKIPPABLE_MAGIC, Footer, LayerReader, pack_tree

REPO = Path(__file__).resolve().parents[2]
AS_LIMIT = 1 << 30          # the child's address space: a bomb that inflates dies of MemoryError
RSS_BOUND_MIB = 400         # what a refused bomb may cost (python + click + zstandard ~ 60 MiB)
SECONDS_BOUND = 30.0
MiB = 1 << 20


@dataclasses.dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    maxrss_mib: float
    seconds: float


# The CLI under a wrapper that records its own peak RSS (VmHWM of the mm exec made) at exit:
# ``wait4``'s ru_maxrss would report the forking pytest's size, because Linux carries a
# process's maxrss across fork+exec.
_MEASURED_MAIN = """
import atexit, os, runpy, sys
def _record(path=os.environ.pop("ENVBUILD_TEST_HWM_FILE")):
    with open("/proc/self/status") as f:
        hwm = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(path, "w") as out:
        out.write(hwm)
atexit.register(_record)
sys.argv = ["envbuild", *sys.argv[1:]]
runpy.run_module("envbuild.cli", run_name="__main__", alter_sys=True)
"""


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120.0,
            discard_stdout: bool = False) -> Run:
    """``python -m envbuild.cli ARGS`` with its address space capped; its peak RSS is the
    VmHWM it reports at exit (infinite if it died without reporting)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    hwm_path = cwd / ".bomb-hwm"
    hwm_path.unlink(missing_ok=True)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "ENVBUILD_TEST_HWM_FILE": str(hwm_path),
                **(env or {})}
    out_path, err_path = cwd / ".bomb-stdout", cwd / ".bomb-stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", _MEASURED_MAIN, *args], cwd=cwd,
                             env=full_env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL if discard_stdout else out, stderr=err,
                             preexec_fn=limit)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        seconds = time.monotonic() - t0
    try:
        maxrss_mib = int(hwm_path.read_text()) / 1024  # VmHWM is in kB
    except (OSError, ValueError):
        maxrss_mib = float("inf")
    return Run(p.returncode, out_path.read_text(errors="replace"),
               err_path.read_text(errors="replace"), maxrss_mib, seconds)


def assert_refused(run: Run, *needles: str) -> None:
    """Exit 1, one ``error:`` line naming what was wrong, no traceback, bounded cost."""
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.code == 1, (run.code, run.stderr[-3000:])
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert run.maxrss_mib < RSS_BOUND_MIB, f"peak RSS {run.maxrss_mib:.0f} MiB: {errors[0]}"
    assert run.seconds < SECONDS_BOUND, f"took {run.seconds:.1f} s: {errors[0]}"


# -- crafting layers -----------------------------------------------------------------------


def assemble(frames: list[bytes], toc_frame: bytes, toc_usize: int) -> bytes:
    """A blob from data frames and a compressed TOC, with a footer whose digest matches."""
    body = b"".join(frames)
    footer = Footer(len(body), len(toc_frame), toc_usize,
                    hashlib.sha256(toc_frame).digest()).encode()
    return body + struct.pack("<II", SKIPPABLE_MAGIC, len(toc_frame)) + toc_frame + footer


def split_frames(data: bytes, reader: LayerReader) -> list[bytes]:
    out, off = [], 0
    for csize, _ in reader.toc.frames:
        out.append(data[off:off + csize])
        off += csize
    return out


def zeros_frame(n: int, *, declare: bool) -> bytes:
    """One zstd frame of ``n`` zero bytes, made in 1 MiB pieces (never ``n`` bytes in memory);
    with ``declare`` its header carries the content size."""
    cobj = zstandard.ZstdCompressor(level=3).compressobj(size=n if declare else -1)
    block = bytes(MiB)
    parts = [cobj.compress(block) for _ in range(n // MiB)]
    parts.append(cobj.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def base_layer(tmp_path_factory):
    """A real layer: one 1 MiB file in a frame of its own, and a small file."""
    src = tmp_path_factory.mktemp("src")
    (src / "big").write_bytes(os.urandom(MiB))
    (src / "small").write_text("small\n")
    buf = io.BytesIO()
    pack_tree(src, buf)
    data = buf.getvalue()
    reader = LayerReader(lambda off, n: data[off:off + n], len(data), name="base")
    return data, reader


def toc_bomb(base_layer, *, honest_footer: bool) -> bytes:
    """The real layer's frames, then a TOC of ~620 MB of JSON (the same entry over and over)
    in a few MB of zstd; the footer declares its real size or 1 MiB."""
    data, reader = base_layer
    toc = reader.toc
    entry = (b'{"chunks":[],"devmajor":0,"devminor":0,"digest":null,"gid":0,"linkname":"",'
             b'"mode":493,"mtime":0,"path":"%s","size":0,"type":"dir","uid":0,"xattrs":{}},')
    head = (b'{"diff_id":"%s","entries":[' % toc.diff_id.encode())
    tail = (b'{"chunks":[],"devmajor":0,"devminor":0,"digest":null,"gid":0,"linkname":"",'
            b'"mode":493,"mtime":0,"path":"last","size":0,"type":"dir","uid":0,"xattrs":{}}],'
            b'"frames":%s,"framing":"lazy","tar_size":%d,"version":1}'
            % (str([list(f) for f in toc.frames]).replace(" ", "").encode(), toc.tar_size))
    cobj = zstandard.ZstdCompressor(level=3).compressobj()
    parts, usize = [cobj.compress(head)], len(head)
    chunk = b"".join(entry % (b"d%07d" % i) for i in range(6700))  # ~1 MiB of entries
    for _ in range(620):
        parts.append(cobj.compress(chunk))
        usize += len(chunk)
    parts += [cobj.compress(tail), cobj.flush()]
    usize += len(tail)
    z = b"".join(parts)
    return assemble(split_frames(data, reader), z, usize if honest_footer else MiB)


def frame_bomb(base_layer, *, declare: bool) -> bytes:
    """The real layer with the frame of ``big`` (1 MiB in the TOC) replaced by a frame of
    3 GiB of zeros; the TOC and footer are rebuilt to match the new frame's size."""
    data, reader = base_layer
    frames = split_frames(data, reader)
    chunk = reader.stat("big").chunks[0]
    i = next(k for k, (off, _) in enumerate(_offsets(reader)) if off == chunk.offset)
    bomb = zeros_frame(3 << 30, declare=declare)
    frames[i] = bomb
    toc = reader.toc
    toc.entries = reader.entries()
    toc.frames = [*toc.frames[:i], (len(bomb), toc.frames[i][1]), *toc.frames[i + 1:]]
    toc_json = toc.to_bytes()
    return assemble(frames, zstandard.ZstdCompressor().compress(toc_json), len(toc_json))


def _offsets(reader: LayerReader):
    off = 0
    for csize, usize in reader.toc.frames:
        yield off, usize
        off += csize


@pytest.fixture(scope="module")
def bombs(base_layer, tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    made = {
        "toc-honest": toc_bomb(base_layer, honest_footer=True),
        "toc-lying": toc_bomb(base_layer, honest_footer=False),
        "frame-declared": frame_bomb(base_layer, declare=True),
        "frame-undeclared": frame_bomb(base_layer, declare=False),
    }
    for name, blob in made.items():
        (d / f"{name}.layer").write_bytes(blob)
    return d


# -- layers --------------------------------------------------------------------------------


def test_bombs_are_small_and_inflate(bombs):
    """The inputs are what the issue describes: a few MB that inflate to hundreds of MB / GiB."""
    for name in ("toc-honest", "toc-lying"):
        blob = (bombs / f"{name}.layer").read_bytes()
        f = Footer.decode(blob[-FOOTER_SIZE:])
        assert len(blob) < 8 * MiB
        z = blob[f.toc_offset + 8:f.toc_offset + 8 + f.toc_csize]
        inflated = sum(len(c) for c in zstandard.ZstdDecompressor().read_to_iter(z))
        assert inflated > 600 * MiB, name
    for name in ("frame-declared", "frame-undeclared"):
        assert (bombs / f"{name}.layer").stat().st_size < 2 * MiB


@pytest.mark.parametrize("name", ["toc-honest", "toc-lying"])
@pytest.mark.parametrize("command", ["ls", "verify", "unpack", "stat"])
def test_toc_bomb_is_refused_with_bounded_memory(bombs, name, command, tmp_path):
    args = ["layer", command, str(bombs / f"{name}.layer")]
    if command == "unpack":
        args.append(str(tmp_path / "out"))
    run = run_cli(*args, cwd=tmp_path)
    assert_refused(run, f"{name}.layer", "TOC")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("name", ["frame-declared", "frame-undeclared"])
@pytest.mark.parametrize("command", ["verify", "unpack", "cat"])
def test_frame_bomb_is_refused_with_bounded_memory(bombs, base_layer, name, command, tmp_path):
    _, reader = base_layer
    offset = reader.stat("big").chunks[0].offset
    args = ["layer", command, str(bombs / f"{name}.layer")]
    if command == "unpack":
        args.append(str(tmp_path / "out"))
    if command == "cat":
        args.append("big")
    run = run_cli(*args, cwd=tmp_path)
    assert_refused(run, f"{name}.layer", f"frame at offset {offset}")


def test_a_huge_file_is_read_in_bounded_memory(tmp_path):
    """A file of zeros larger than the child's whole address space (1 GiB + 128 MiB; a
    sparse file packed: a few hundred KB of layer) through ``layer cat`` and ``layer
    verify``: streamed, never held whole (it could not be: the address space is 1 GiB).
    (1.5 GiB before: the extra 384 MiB proved nothing more and cost ~6 s.)"""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "zeros", "wb") as f:
        f.truncate(AS_LIMIT + 128 * MiB)
    with open(tmp_path / "zeros.layer", "wb") as out:
        pack_tree(src, out)
    assert (tmp_path / "zeros.layer").stat().st_size < 2 * MiB
    run = run_cli("layer", "cat", "zeros.layer", "zeros", cwd=tmp_path, discard_stdout=True)
    assert run.code == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.maxrss_mib < RSS_BOUND_MIB, run.maxrss_mib
    run = run_cli("layer", "verify", "zeros.layer", cwd=tmp_path)
    assert run.code == 0 and run.stdout.startswith("ok: "), run.stderr[-2000:]
    assert run.maxrss_mib < RSS_BOUND_MIB, run.maxrss_mib


# -- YAML / JSON ---------------------------------------------------------------------------

#: "billion laughs": nine levels of nine aliases, 9^9 (~387 million) strings from ~600 bytes
LAUGHS = 'lol0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"lol{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9))


def test_yaml_alias_bomb_in_a_definition_is_refused_before_expansion(tmp_path):
    defs = tmp_path / "defs" / "envs"
    defs.mkdir(parents=True)
    (defs / "bomb.yaml").write_text("apiVersion: envbuild/v1\nkind: Env\nname: bomb\n"
                                    "base: x\ndescription: laughs\n" + LAUGHS)
    run = run_cli("--defs", "defs", "validate", cwd=tmp_path)
    assert_refused(run, "1 problem")
    assert "defs/envs/bomb.yaml:11:12: alias *l4 makes" in run.stderr  # where it overflows
    assert "alias bomb" in run.stderr
    assert run.seconds < 5


def test_yaml_recursive_alias_and_deep_nesting_are_refused(tmp_path):
    defs = tmp_path / "defs"
    defs.mkdir()
    (defs / "rec.yaml").write_text("apiVersion: envbuild/v1\nkind: Env\nname: rec\n"
                                   "config: &c {env: *c}\n")
    (defs / "deep.yaml").write_text("apiVersion: envbuild/v1\nkind: Env\nname: deep\n"
                                    "config: " + "[" * 200 + "]" * 200 + "\n")
    run = run_cli("--defs", "defs", "validate", cwd=tmp_path)
    assert "Traceback" not in run.stderr and run.code == 1, run.stderr
    assert "defs/rec.yaml:4:18: alias *c is inside its own anchor" in run.stderr
    assert "defs/deep.yaml:4:72: document has nesting deeper than 64 levels" in run.stderr


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_job_manifest_bombs_are_refused(tmp_path, suffix):
    if suffix == "yaml":
        text = "apiVersion: envbuild/v1\nkind: JobManifest\n" + LAUGHS + "groups: []\n"
        needle = "alias bomb"
    else:  # JSON has no aliases: depth is the bomb (json.loads would raise RecursionError)
        text = '{"apiVersion": "envbuild/v1", "groups": ' + "[" * 500 + "]" * 500 + "}"
        needle = "nesting deeper than 64 levels"
    (tmp_path / f"jobs.{suffix}").write_text(text)
    run = run_cli("job", "resolve", f"jobs.{suffix}", "--store", str(tmp_path / "store"),
                  cwd=tmp_path)
    assert_refused(run)
    assert f"jobs.{suffix}:" in run.stderr and needle in run.stderr, run.stderr
    assert not (tmp_path / f"jobs.resolved.{suffix}").exists()


# -- sparse files in a snapshot ------------------------------------------------------------


def test_sparse_files_in_a_sandbox_are_reported_and_capped_by_the_disk_limit(busybox_store):
    """Two sparse 1000 MiB files pack into a few KB but restore as 2000 MiB: the policy counts
    apparent sizes against the sandbox's disk limit, and reports every sparse file."""
    from runtime_shim.node.packdiff import SnapshotPolicy, SnapshotRefused
    from runtime_shim.sdk.sandbox import Limits, Sandbox

    store, node = busybox_store
    small_disk = 1536 << 20  # room for the sparse files (they hold no blocks), not for restoring
    limits = Limits(disk_bytes=small_disk)
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node, limits=limits) as sb:
        r = sb.exec(["sh", "-c", "truncate -s 1000M /a /b && du -k /a /b && ls -l /a /b"])
        assert r.exit_code == 0, r.stderr
        assert all(int(line.split()[0]) < 1024 for line in r.stdout.decode().splitlines()[:2])

        # no disk limit to tie to (or the 10 GiB default): packed, and both files reported
        result = sb.pack_diff(policy=SnapshotPolicy.for_limits(None))
        sparse = {d["path"]: d["reason"] for d in result.report.decisions
                  if d["action"] == "sparse"}
        assert set(sparse) == {"a", "b"}, result.report.decisions
        assert "1048576000 bytes apparent" in sparse["a"]
        assert result.report.sparse_bytes > 2 * 1000 * MiB - 2 * MiB
        assert result.report.to_json()["sparse_bytes"] == result.report.sparse_bytes
        assert result.size < 1 * MiB  # the bomb: KBs in the store, 2000 MiB restored

        # the default policy takes the sandbox's own disk limit: it could not restore -> refused
        with pytest.raises(SnapshotRefused, match="more than 1610612736 bytes changed .apparent"):
            sb.pack_diff("snap/sparse-bomb")
    assert "snap/sparse-bomb" not in store.list_refs()


# -- JSON of a lock read from the store ----------------------------------------------------


@pytest.mark.parametrize("kind", ["deep", "layer", "list"])
def test_hostile_lock_json_in_the_store_is_refused(tmp_path, kind):
    """A ref whose "lock" is a 200 KB array nested 100,000 deep (``json`` raises
    RecursionError), a 100 MB blob (a layer named as a lock), or a JSON list: ``job resolve``
    and ``job verify`` give one error line, with bounded memory."""
    from envbuild.store import put_bytes
    from envbuild.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    blob = {"deep": b"[" * 100_000 + b"]" * 100_000, "layer": bytes(100 * MiB),
            "list": b"[1, 2, 3]"}[kind]
    digest = put_bytes(store, blob)
    store.put_ref("env/hostile", digest)
    (tmp_path / "jobs.yaml").write_text("apiVersion: envbuild/v1\nkind: JobManifest\n"
                                        "groups:\n  - {name: g, lock: env/hostile}\n")
    needle = {"deep": "nested too deeply", "layer": "too large",
              "list": "is not an OCI image manifest"}[kind]
    run = run_cli("job", "resolve", "jobs.yaml", "--store", str(tmp_path / "store"),
                  cwd=tmp_path)
    assert_refused(run, "cannot resolve 1 of 1 group")
    assert needle in run.stderr, run.stderr  # the group's problem, on the line before
    assert not (tmp_path / "jobs.resolved.yaml").exists()
    run = run_cli("job", "verify", "jobs.yaml", "--store", str(tmp_path / "store"),
                  cwd=tmp_path)
    assert "Traceback" not in run.stderr and run.code == 1, (run.code, run.stderr)
    assert run.maxrss_mib < RSS_BOUND_MIB, run.maxrss_mib
