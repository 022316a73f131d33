"""``envbuild layer pack|ls|cat|unpack|verify|index|stat``: make and inspect layer blobs.

LAYER is a layer file or a digest in the store (``sha256:<hex>``, or a unique prefix of at least
12 hex digits). Each command parses, calls the public API of ``envbuild.layers`` and renders;
every ``--json`` prints through ``envbuild.cli.output.echo_json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.errors import EnvbuildError

if TYPE_CHECKING:
    from envbuild.layers import LayerInfo, LayerReader

# envbuild.layers.REF_HELP, written out: importing envbuild.layers for a help text would cost
# every CLI start-up (tests/unit/test_layers_api.py checks that the two agree)
LAYER_HELP = ("LAYER is a layer file, or a digest in the store: sha256:<hex> or a unique prefix "
              "of at least 12 hex digits.")
_CAT_BUFFER = 64 << 20  # layer cat verifies files up to this size before writing any byte


def register(group: click.Group) -> None:
    group.add_command(layer)


@click.group()
def layer() -> None:
    """Pack, list, read, unpack, verify and inspect layer blobs (format v1)."""


def open_layer(app: App, ref: str) -> LayerReader:
    """The ``LayerReader`` for LAYER; the store is opened only for digests, and never created."""
    from envbuild.layers import open_layer as open_ref

    return open_ref(ref, lambda: _existing_store(app), where=app.settings.store_url)


def _existing_store(app: App):
    from envbuild.errors import BlobNotFound

    url = app.settings.store_url
    if "://" not in url and not Path(url).is_dir():
        raise BlobNotFound(f"there is no store at {url}",
                           hint="pass --store DIR or set ENVBUILD_STORE, or give a layer file")
    return app.open_store()


def _echo_fields(fields: dict) -> None:
    width = max(map(len, fields)) + 2
    for key, value in fields.items():
        click.echo(f"{key:<{width}}{value}")


@layer.command("pack")
@click.argument("src", metavar="DIR", type=click.Path(path_type=Path))
@click.option("-o", "--output", metavar="FILE", type=click.Path(path_type=Path),
              help="Write the blob to FILE (atomically) instead of the store.")
@click.option("--store", "to_store", is_flag=True,
              help="Put the blob into the store that `envbuild --store DIR` names (the "
                   "default without -o; with -o: both).")
@click.option("--framing", type=click.Choice(["lazy", "compact"]), default="lazy",
              show_default=True,
              help="lazy: big files in frames of their own; compact: ~4 MiB frames.")
@click.option("--overlay-upper", is_flag=True,
              help="DIR is an overlayfs upper dir: turn its whiteouts into OCI whiteouts.")
@click.option("--no-devices", is_flag=True, help="Refuse device nodes and FIFOs.")
@json_option("Print one JSON object.")
@pass_app
def pack(app: App, src: Path, output: Path | None, to_store: bool, framing: str,
         overlay_upper: bool, no_devices: bool, as_json: bool) -> None:
    """Pack DIR into a layer; mtimes are clamped to $SOURCE_DATE_EPOCH (default 0)."""
    from envbuild.layers import pack_layer

    use_store = output is None or to_store
    if sys.stderr.isatty() and not as_json:
        click.echo(f"packing {src} ...", err=True)
    store = app.open_store() if use_store else None
    info = pack_layer(src, output=output, store=store, framing=framing,
                      overlay_upper=overlay_upper, allow_devices=not no_devices,
                      source_date_epoch=app.settings.source_date_epoch)
    if store is not None:
        _index_stored(store, info.digest)
    where = {"output": str(output) if output else None,
             "store": app.settings.store_url if use_store else None}
    if as_json:
        echo_json({**info.to_json(), **where})
    else:
        _render_info(info, where)


def _index_stored(store, digest: str) -> None:
    """Store the import index of the layer's pycs, for lazy sandboxes (a hint: never fails)."""
    from envbuild.layers import LayerReader
    from runtime_shim.lazyfs import index_reader

    try:
        with LayerReader.from_store(store, digest) as reader:
            index_reader(store, reader, digest)
    except (EnvbuildError, OSError) as e:
        click.echo(f"warning: import index of {digest[:19]}: {e}", err=True)


@layer.command("ls", epilog=LAYER_HELP)
@click.argument("layer_ref", metavar="LAYER")
@click.option("-l", "--long", "long_", is_flag=True,
              help="Type and mode, uid/gid, size, mtime (UTC), link target, like tar -tv.")
@json_option("Print one JSON object with every TOC entry (without chunks).")
@pass_app
def ls(app: App, layer_ref: str, long_: bool, as_json: bool) -> None:
    """List the members of LAYER from its table of contents, in tar order."""
    from envbuild.layers import add_hints, display_path, entry_json, long_line

    with open_layer(app, layer_ref) as reader, add_hints(reader):
        entries = reader.entries()
    if as_json:
        echo_json({"layer": reader.name,
                   "entries": [entry_json(e, chunks=False) for e in entries]})
        return
    for e in entries:
        click.echo(long_line(e) if long_ else display_path(e))


@layer.command("cat", epilog=LAYER_HELP)
@click.argument("layer_ref", metavar="LAYER")
@click.argument("path")
@pass_app
def cat(app: App, layer_ref: str, path: str) -> None:
    """Write the contents of file PATH in LAYER to stdout, reading only its frames."""
    from envbuild.layers import iter_member

    with open_layer(app, layer_ref) as reader:
        _write_held(iter_member(reader, path), sys.stdout.buffer)
    sys.stdout.flush()


def _write_held(pieces, out) -> None:
    """Write ``pieces`` to ``out``, holding back up to ``_CAT_BUFFER`` bytes: a file that size
    is verified before anything is written; a bigger one streams (a hostile TOC can declare any
    size: frames of zeros inflate ~30,000x), and a digest mismatch then ends its output with an
    error line, exit 1."""
    held: list[bytes] | None = []
    size = 0
    for piece in pieces:
        if held is not None:
            held.append(piece)
            size += len(piece)
            if size <= _CAT_BUFFER:
                continue
            piece, held = b"".join(held), None
        out.write(piece)
    if held:
        out.write(b"".join(held))


@layer.command("unpack", epilog=LAYER_HELP)
@click.argument("layer_ref", metavar="LAYER")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--whiteouts", type=click.Choice(["apply", "overlay", "keep"]),
              default="apply", show_default=True,
              help="apply: delete what the layer's whiteouts name from DEST, write no "
                   ".wh.* files; overlay: write overlayfs whiteouts (DEST becomes an "
                   "overlay lower dir); keep: write .wh.* files as they are.")
@click.option("--allow-devices", is_flag=True,
              help="Create the layer's device nodes (refused by default: a layer's "
                   "/dev/sda, mode 0666, is the host's disk).")
@click.option("--keep-setid", is_flag=True,
              help="Keep setuid/setgid bits on files (cleared by default).")
@click.option("--no-devices", is_flag=True, hidden=True)  # the default now
@json_option("Print one JSON object: the layer, DEST and the number of members.")
@pass_app
def unpack(app: App, layer_ref: str, dest: Path, whiteouts: str, allow_devices: bool,
           keep_setid: bool, no_devices: bool, as_json: bool) -> None:
    """Extract LAYER into DEST.

    DEST is created if missing. It may hold a tree already: the layer is stacked onto it
    (members replace what is at their path, whiteouts delete with --whiteouts apply), which
    is how layers compose. Unsafe members (absolute, .., through a symlink) are refused; a
    layer with device nodes is refused unless --allow-devices, and setuid/setgid bits are
    cleared unless --keep-setid (a layer is untrusted input; DEST is on the host).
    """
    from envbuild.layers import unpack_into

    with open_layer(app, layer_ref) as reader:
        unpack_into(reader, dest, whiteouts=whiteouts,
                    allow_devices=allow_devices and not no_devices,
                    strip_setid=not keep_setid)
        entries = len(reader.entries())
    if as_json:
        echo_json({"layer": reader.name, "dest": str(dest), "entries": entries,
                   "whiteouts": whiteouts})
    else:
        click.echo(f"unpacked {reader.name} into {dest}", err=True)


@layer.command("verify", epilog=LAYER_HELP)
@click.argument("layer_ref", metavar="LAYER")
@json_option("Print one JSON object.")
@pass_app
def verify(app: App, layer_ref: str, as_json: bool) -> None:
    """Check every byte of LAYER: frames, tar, TOC, digests (a stored blob must hash to its
    digest; for a file, the digest printed is its sha256)."""
    from envbuild.layers import verify_reader
    from envbuild.sizes import human_size

    with open_layer(app, layer_ref) as reader:
        info = verify_reader(reader)
    if as_json:
        echo_json({**info.to_json(), "ok": True})
        return
    click.echo(f"ok: {info.digest} ({info.entries} entries, {human_size(info.size)} "
               f"compressed, {human_size(info.uncompressed_size)} uncompressed, "
               f"{info.frames} frames)")


@layer.command("index", epilog=LAYER_HELP)
@click.argument("layer_refs", metavar="[LAYER]...", nargs=-1)
@click.option("--env", "envs", multiple=True, metavar="NAME",
              help="Every layer of the lock NAME (an env name, ref or lock digest); "
                   "repeatable.")
@json_option("Print one JSON object.")
@pass_app
def index_cmd(app: App, layer_refs: tuple[str, ...], envs: tuple[str, ...],
              as_json: bool) -> None:
    """Store the import index of layers in the store: each `.pyc`'s module-level imports,
    which lazy sandboxes use to fetch a module's whole import closure on its first
    import. Builds, `layer pack --store` and pack-diff index every layer they store;
    this is for layers stored by an older envbuild or copied in by other means."""
    from envbuild.sizes import human_size

    store = _existing_store(app) if (layer_refs or envs) else None
    results = []
    for digest in _index_digests(app, store, layer_refs, envs):
        row = _index_one(app, store, digest)
        results.append(row)
        if not as_json:
            click.echo(f"{digest[:19]}  " + (
                f"{row['pycs']} pycs indexed ({human_size(row['bytes'])}) in "
                f"{row['seconds']:.1f} s" if row["bytes"] else "no pycs: nothing to index"))
    if as_json:
        echo_json({"layers": results})


def _index_digests(app: App, store, layer_refs: tuple[str, ...],
                   envs: tuple[str, ...]) -> list[str]:
    """The stored layers ``layer index`` names: digests (prefixes) and every layer of each
    lock in ``envs``, each once, in order."""
    from envbuild.errors import LayerError

    if not layer_refs and not envs:
        raise LayerError("layer index: no layer named",
                         hint="give layer digests, or --env NAME for every layer of a lock")
    digests: list[str] = []
    for ref in layer_refs:
        if not ref.startswith("sha256:") and Path(ref).exists():
            raise LayerError(f"layer index {ref}: a layer file has no store record",
                             hint="put it into the store first: envbuild layer pack "
                                  "--store, or give its digest")
        with open_layer(app, ref) as reader:
            digests.append(reader.name)
    if envs:
        from runtime_shim.node import resolve

        for name in envs:
            digests += [x.digest for x in resolve(store, name).layers]
    return list(dict.fromkeys(digests))


def _index_one(app: App, store, digest: str) -> dict[str, Any]:
    """Index one stored layer: ``{"layer", "pycs", "bytes", "seconds"}``."""
    import time

    from runtime_shim.lazyfs import index_reader

    t0 = time.monotonic()
    with open_layer(app, digest) as reader:
        rec = index_reader(store, reader, digest)
    return {"layer": digest, "pycs": len(rec["pycs"]) if rec else 0,
            "bytes": len(json.dumps(rec, separators=(",", ":"))) if rec else 0,
            "seconds": round(time.monotonic() - t0, 3)}


@layer.command("stat", epilog=LAYER_HELP)
@click.argument("layer_ref", metavar="LAYER")
@click.argument("path", required=False)
@json_option("Print one JSON object.")
@click.option("--lazy", is_flag=True,
              help="Also report what was fetched to answer (ranged reads, bytes): the cost "
                   "of opening the layer lazily from its store.")
@pass_app
def stat_cmd(app: App, layer_ref: str, path: str | None, as_json: bool, lazy: bool) -> None:
    """Summarise LAYER from its footer and TOC, or show the TOC entry of PATH (with its
    chunks). Reads no data frames."""
    from envbuild.layers import add_hints, entry_json, layer_summary, member_entry

    with open_layer(app, layer_ref) as reader, add_hints(reader):
        doc = layer_summary(reader) if path is None else entry_json(member_entry(reader, path))
        if lazy:  # S3 issue: footer + TOC are the only reads (envbuild.store.lazy)
            doc["fetched"] = {"ranges": reader.stats.ranges,
                              "bytes": reader.stats.bytes_fetched}
    if as_json:
        echo_json(doc)
    elif path is None:
        _render_summary(doc)
    else:
        _render_entry(doc)


def _render_info(info: LayerInfo, where: dict) -> None:
    from envbuild.sizes import human_size

    fields: dict[str, Any] = {
        "digest": info.digest, "diff_id": info.diff_id,
        "size": f"{info.size} ({human_size(info.size)}) compressed, "
                f"{info.uncompressed_size} ({human_size(info.uncompressed_size)}) uncompressed",
        "entries": info.entries, "frames": f"{info.frames} ({info.framing})",
        "toc_digest": info.toc_digest,
    }
    if where["output"]:
        fields["written to"] = where["output"]
    if where["store"]:
        fields["stored in"] = where["store"]
    _echo_fields(fields)


def _render_summary(doc: dict) -> None:
    from envbuild.sizes import human_size

    fields = dict(doc)
    for key in ("size", "uncompressed_size", "toc_size", "toc_uncompressed_size"):
        fields[key] = f"{doc[key]} ({human_size(doc[key])})"
    fields["types"] = ", ".join(f"{n} {t}" for t, n in doc["types"].items()) or "-"
    if "fetched" in doc:
        fields["fetched"] = (f"{doc['fetched']['ranges']} ranged reads, "
                             f"{doc['fetched']['bytes']} bytes")
    _echo_fields(fields)


def _render_entry(doc: dict) -> None:
    chunks = doc.pop("chunks")
    doc["mode"] = f"{doc['mode']:04o}"
    doc["xattrs"] = ", ".join(doc["xattrs"]) or "-"
    doc["linkname"] = doc["linkname"] or "-"
    doc["digest"] = doc["digest"] or "-"
    doc["chunks"] = len(chunks)
    _echo_fields(doc)
    if chunks:
        click.echo(f"  {'offset':>12} {'csize':>10} {'uoffset':>12} {'usize':>10} {'inner':>8}")
        for c in chunks:
            click.echo(f"  {c['offset']:>12} {c['csize']:>10} {c['uoffset']:>12} "
                       f"{c['usize']:>10} {c['inner']:>8}")
