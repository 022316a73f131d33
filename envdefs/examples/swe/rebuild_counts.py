#!/usr/bin/env python3
"""Rebuild counts and bytes stored for three changes, envbuild's layering against the
per-instance image scheme, both measured in the same run with real builds.

The SWE-bench harness builds ``base`` -> ``env`` (one image per repo+version) -> ``instance``
(one per task), and agent frameworks put the agent layer on top of each instance image. Each
image layer is keyed by its parent, so a change rebuilds every image above it. This script
builds both schemes from the same definitions, each into its own store:

- **envbuild** (``layered/``): the example as written: the env layers, instances and the agent
  key on the base's abi; an env is a lock over them.
- **per-instance** (``per-instance/``): generated from the same definitions as chains of Bases,
  each ``from: {base: <the layer below>}``, so each layer keys on its parent's key exactly like
  a Dockerfile ``FROM``: base -> env (shared by the tasks of one repo version) -> instance ->
  agent, with the same steps (an archive source becomes a ``copy`` of the archive plus ``tar
  --strip-components``). Built with envbuild itself (same executor, same layer format), so
  the byte counts compare like with like; not with ``docker build``.

The base is the same in both trees: a Dockerfile base (``base/Dockerfile`` on the env
``swe-os``, built by BuildKit in a private dockerd), whose change is a Dockerfile change.

Then it applies the changes one after the other to both trees (``--change``; defaults: the
agent toolkit's script, the revision line of the base's Dockerfile, one repo version's env
layer), rebuilds both, and
prints per change the layers each rebuilt (``built`` in ``envbuild build --json``), the envs
re-locked, the layer bytes each built (the rebuilt layers' blob sizes: what ``docker build``
would write and push, its layers being non-reproducible) and the bytes each store really gained
(new blob files: layers, configs, locks; envbuild's deterministic layers dedupe a rebuilt layer
whose bytes did not change, e.g. a venv rebuilt on a new base, or six identical agent layers).

    python envdefs/examples/swe/rebuild_counts.py [--seed-store ./cache] [--work DIR] [--json]

``--seed-store`` (default the repository's ``cache/`` if it exists) is read with ``--cache-from`` for the
*initial* builds only (layers already built there are copied, not rebuilt); the changes are
always built. Needs root (runc), dockerd (docker.io), network for the base (Debian's apt) and
the env layers (PyPI), ~8-12 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

#: name, file (relative to the tree), text to replace, replacement
DEFAULT_CHANGES = (
    ("agent toolkit", "files/agent/swe-agent", 'VERSION = "1"', 'VERSION = "2"'),
    # the base is a Dockerfile base (base/Dockerfile): a base change is a Dockerfile change,
    # one `docker build` (apt-get of python3 on swe-os) in envbuild, and every image above it
    # in the per-instance scheme
    ("base (its Dockerfile)", "base/Dockerfile", "swe base revision 1", "swe base revision 2"),
    ("one repo version (toolz 1.0.0 env)", "toolkits/env-toolz-1.0.0.yaml",
     "env revision: 1", "env revision: 2"),
)


# ----------------------------------------------------------------------------- the chain tree


def _documents(tree: Path) -> dict[str, tuple[Path, dict]]:
    """name -> (file relative to ``tree``, the document) of every definition in ``tree``."""
    out = {}
    for f in sorted(tree.rglob("*.y*ml")):
        rel = f.relative_to(tree)
        if any(p.startswith(".") for p in rel.parts):
            continue
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out[doc["name"]] = (rel, doc)
    return out


def _base_doc(name: str, parent: str, abi: str, steps: list, config: dict | None,
              description: str) -> dict:
    doc = {"apiVersion": "envbuild/v1", "kind": "Base", "name": name,
           "description": description, "abi": abi, "from": {"base": parent}, "steps": steps}
    if config:
        doc["config"] = config
    return doc


def _source_steps(ws: dict) -> list:
    """A workspace's source as Base steps: what a Dockerfile's COPY + RUN tar would do (not
    under /tmp: a build step's /tmp is its own scratch, not the rootfs)."""
    src, dest = ws["source"], ws.get("dest", "/workspace")
    if "archive" in src:
        a = src["archive"]
        strip = int(a.get("strip_components", 0))
        return [{"copy": {"src": a["path"], "dest": "/.swe-source.tar.gz", "mode": "0644"}},
                {"run": f"set -eu\nmkdir -p {dest}\n"
                        f"tar -xzf /.swe-source.tar.gz --strip-components={strip} -C {dest}\n"
                        "rm /.swe-source.tar.gz\n", "network": "none"}]
    raise SystemExit(f"{ws['name']}: only archive sources are turned into a chain here")


def write_chain_tree(layered: Path, chain: Path, agent: str) -> dict[str, list[str]]:
    """Write the per-instance tree for ``layered`` into ``chain`` (replacing it); return env ->
    its chain of layer names (bottom to top, base chain excluded)."""
    if chain.exists():
        shutil.rmtree(chain)
    # the files copy steps and archives refer to, at the same relative paths
    shutil.copytree(layered, chain, ignore=shutil.ignore_patterns("*.yaml", "*.yml"))
    docs = _documents(layered)
    chains: dict[str, list[str]] = {}
    written: set[str] = set()

    def put(rel_dir: Path, doc: dict) -> None:
        if doc["name"] in written:
            return  # shared (an env image used by several tasks)
        written.add(doc["name"])
        path = chain / rel_dir / f"{doc['name']}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")  # JSON is YAML

    for _name, (rel, doc) in docs.items():
        if doc["kind"] == "Base":
            put(rel.parent, doc)
    for name, (rel, env) in sorted(docs.items()):
        if env["kind"] != "Env":
            continue
        if not env.get("workspace") and not env.get("toolkits"):
            put(rel.parent, env)  # not a task: an env a Dockerfile base builds on (swe-os)
            continue
        base = env["base"]
        abi = docs[base][1]["abi"]
        parent, names = base, []
        deps = [t for t in env.get("toolkits", []) if t != agent]
        tops = [t for t in env.get("toolkits", []) if t == agent]
        # base -> env image(s) of the repo version -> instance -> agent
        for i, tk in enumerate(deps):
            rel, doc = docs[tk]
            # an env image is shared by the tasks whose chain below it is the same
            nm = f"c-{'-'.join(deps[:i + 1])}"
            put(rel.parent, _base_doc(nm, parent, abi, doc.get("steps", []), doc.get("config"),
                                      f"per-instance chain: {tk} on {parent}"))
            parent = nm
            names.append(nm)
        if env.get("workspace"):
            rel, ws = docs[env["workspace"]]
            nm = f"c-{name}-instance"
            put(rel.parent, _base_doc(nm, parent, abi, _source_steps(ws) + ws.get("steps", []),
                                      ws.get("config"), f"per-instance chain: {ws['name']}"))
            parent = nm
            names.append(nm)
        for tk in tops:
            rel, doc = docs[tk]
            nm = f"c-{name}-{tk}"
            put(rel.parent, _base_doc(nm, parent, abi, doc.get("steps", []), doc.get("config"),
                                      f"per-instance chain: {tk} on {parent}"))
            parent = nm
            names.append(nm)
        put(Path("envs"), {"apiVersion": "envbuild/v1", "kind": "Env", "name": name,
                           "base": parent, "config": env.get("config") or {}})
        chains[name] = names
    return chains


# ----------------------------------------------------------------------------- docker build


_ENV_FROM = re.compile(r"envbuild\.invalid/env/([a-z0-9][a-z0-9._-]*)(?![A-Za-z0-9._@:/-])")


#: where a networked RUN of the generated Dockerfiles finds the host's CA bundle: a BuildKit
#: secret mount (not in the image, not in the cache key), as envbuild binds it into its own
#: network steps (the host may reach PyPI only through an intercepting proxy)
CA_TARGET = "/run/secrets/host-ca.crt"
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")


def _dockerfile_steps(steps: list, rel_dir: Path, ca: bool = False) -> list[str]:
    """envbuild steps as Dockerfile instructions (paths relative to the tree, the context)."""
    out = []
    for step in steps:
        if "copy" in step:
            c = step["copy"]
            src = os.path.normpath(rel_dir / c["src"])
            out.append(f"COPY {json.dumps([src, c['dest']])}")
            if c.get("mode"):
                out.append(f"RUN {json.dumps(['chmod', c['mode'], c['dest']])}")
        elif "run" in step:
            env = [f"{k}={v}" for k, v in (step.get("env") or {}).items()]
            mount = ""
            if ca and step.get("network", "host") != "none":  # a run step's default is host
                mount = f"--mount=type=secret,id=hostca,target={CA_TARGET} "
                env = [f"{k}={CA_TARGET}" for k in CA_VARS] + env
            out.append(f"RUN {mount}{json.dumps(['env', *env, 'sh', '-c', step['run']])}")
        else:
            raise SystemExit(f"--docker: step {step} has no Dockerfile equivalent here")
    return out


def docker_images(chain: Path, ca: bool = False
                  ) -> list[tuple[str, str | None, str, Path, list[str]]]:
    """The per-instance tree ``chain`` as Dockerfiles: ``(image tag, parent image tag or None,
    Dockerfile text, context, envs it loads from the envbuild store)``, bottom up. A Dockerfile
    base is its own Dockerfile (``FROM envbuild.invalid/env/E`` -> the image loaded from E's
    lock); a chain Base is ``FROM <parent>`` + its steps + ``ENV`` of its config, the tree as
    context."""
    docs = _documents(chain)
    out: list[tuple[str, str | None, str, Path, list[str]]] = []
    done: set[str] = set()

    def add(name: str) -> None:
        if name in done:
            return
        rel, doc = docs[name]
        src = doc["from"]
        if "base" in src:
            add(src["base"])
            lines = [f"FROM swe/{src['base']}", *_dockerfile_steps(doc.get("steps") or [],
                                                                    rel.parent, ca)]
            lines += [f"ENV {k}={json.dumps(str(v))}"
                      for k, v in ((doc.get("config") or {}).get("env") or {}).items()]
            out.append((f"swe/{name}", f"swe/{src['base']}", "\n".join(lines) + "\n", chain, []))
        elif "dockerfile" in src:
            df = src["dockerfile"]
            context = chain / rel.parent / df["context"]
            text = (context / df.get("file", "Dockerfile")).read_text()
            envs = list(dict.fromkeys(_ENV_FROM.findall(text)))
            # its parent: the (last) env image it builds on, loaded, not built
            parent = f"swe-env/{envs[-1]}:latest" if envs else None
            out.append((f"swe/{name}", parent, _ENV_FROM.sub(r"swe-env/\1", text), context, envs))
        else:
            raise SystemExit(f"--docker: base {name} is not a Dockerfile or a chain of one")
        done.add(name)

    for _name, (_rel, doc) in sorted(docs.items()):
        if doc["kind"] == "Env" and (doc.get("base") or "").startswith("c-"):
            add(doc["base"])
    return out


def docker_build(daemon, chain: Path, store: Path, work: Path, log: Path,
                 previous: dict[str, str]) -> dict:
    """``docker build`` of every image of the per-instance scheme (the daemon's layer cache
    decides what is rebuilt, as in the harness); images whose id changed, and their own layer
    bytes (image size minus its parent's, from ``docker image inspect``)."""
    from envbuild.export import ExportRequest, ExportTarget, export_lock
    from envbuild.store import LocalStore
    from runtime_shim.isolation.stub import host_ca_bundle

    started = time.monotonic()
    ca = host_ca_bundle()
    images = docker_images(chain, ca is not None)
    ids: dict[str, str] = {}
    sizes: dict[str, int] = {}
    parents: dict[str, str | None] = {}
    dfdir = work / "dockerfiles"
    dfdir.mkdir(parents=True, exist_ok=True)

    def docker(*argv: str, capture: bool = False) -> str:
        with log.open("a") as f:
            f.write(f"$ docker {' '.join(argv)[:300]}\n")
            f.flush()
            proc = subprocess.run([daemon.cli, *argv], env=daemon.env(), text=True,
                                  stdin=subprocess.DEVNULL, stderr=f,
                                  stdout=subprocess.PIPE if capture else f)
        if proc.returncode != 0:
            raise SystemExit(f"docker {argv[0]} failed (exit {proc.returncode}); log: {log}")
        return proc.stdout.strip() if capture else ""

    for tag, parent, text, context, envs in images:
        for env in envs:  # the OS env under the Dockerfile base, from envbuild's store
            archive = work / f"env-{env}.tar"
            if not archive.exists():
                export_lock(LocalStore(store), ExportRequest(ref=f"env/{env}", target=ExportTarget(
                    "docker-archive", archive, f"swe-env/{env}:latest")))
            docker("load", "-q", "-i", str(archive))  # again per run: the same image id
        dockerfile = dfdir / (tag.replace("/", "_") + ".Dockerfile")
        dockerfile.write_text(text)
        secret = ["--secret", f"id=hostca,src={ca}"] if ca else []
        docker("build", "--progress=plain", "--network=host", *secret, "-t", tag,
               "-f", str(dockerfile), "--", str(context))
        ids[tag] = docker("image", "inspect", "-f", "{{.Id}}", tag, capture=True)
        sizes[tag] = int(docker("image", "inspect", "-f", "{{.Size}}", tag, capture=True))
        parents[tag] = parent
        if parent is not None and parent not in sizes:  # a loaded env image
            sizes[parent] = int(docker("image", "inspect", "-f", "{{.Size}}", parent,
                                       capture=True))
    built = sorted(t for t in ids if previous.get(t) != ids[t])
    own = {t: sizes[t] - (sizes[parents[t]] if parents[t] else 0) for t in ids}  # type: ignore[index]
    return {"built": built, "images": len(ids), "ids": ids,
            "built_bytes": sum(own[t] for t in built),
            "image_bytes": sum(own.values()),
            "seconds": round(time.monotonic() - started, 1)}


# ----------------------------------------------------------------------------- measuring


def _blobs(store: Path) -> dict[str, int]:
    d = store / "blobs" / "sha256"
    return {p.name: p.stat().st_size for p in d.iterdir()} if d.is_dir() else {}


def build(defs: Path, store: Path, node: Path, cache_from: Path | None,
          log: Path) -> dict:
    """``envbuild build --json`` of ``defs`` into ``store``; its counts and the store growth."""
    before = _blobs(store)
    argv = [sys.executable, "-m", "envbuild.cli", "--store", str(store), "--defs", str(defs)]
    if cache_from is not None:
        argv += ["--cache-from", str(cache_from)]
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node)}
    started = time.monotonic()
    proc = subprocess.run([*argv, "build", "--jobs", "2", "--json"], env=env,
                          capture_output=True, text=True)
    seconds = time.monotonic() - started
    with log.open("a") as f:
        f.write(f"$ {' '.join(argv)} build --json\n{proc.stderr}\n")
    if proc.returncode != 0:
        raise SystemExit(f"build of {defs} failed (exit {proc.returncode}); log: {log}\n"
                         + "\n".join(proc.stderr.splitlines()[-15:]))
    report = json.loads(proc.stdout)
    after = _blobs(store)
    done = [lay for lay in report["layers"] if lay["status"] == "built"]
    return {"built": sorted(lay["name"] for lay in done),
            "relocked": sorted(lk["env"] for lk in report["locks"]),
            "locks": {lk["env"]: lk["digest"] for lk in report["locks"]},
            # what the builds wrote: every rebuilt layer's blob, as a registry of images
            # built by docker (whose layers are not reproducible) would receive them
            "built_bytes": sum(lay["size"] or 0 for lay in done),
            # what this content-addressed store really gained: a rebuilt layer whose bytes
            # did not change (deterministic builds) is already there
            "bytes": sum(s for b, s in after.items() if b not in before),
            "store_bytes": sum(after.values()), "seconds": round(seconds, 1)}


def _apply(tree: Path, rel: str, old: str, new: str) -> None:
    path = tree / rel
    text = path.read_text()
    if old not in text:
        raise SystemExit(f"change: {path} does not contain {old!r}")
    path.write_text(text.replace(old, new, 1))


def measure(defs: Path, work: Path, changes, *, agent: str, seed: Path | None,
            docker: bool = False) -> dict:
    if not docker:
        return _measure(defs, work, changes, agent=agent, seed=seed, daemon=None)
    from envbuild.dockerd import docker_daemon

    # one throwaway private dockerd for the whole run (its layer cache is what a CI runner's
    # would be); egress for apt and PyPI
    with docker_daemon(work / "dockerd", egress_only=True) as daemon:
        return _measure(defs, work, changes, agent=agent, seed=seed, daemon=daemon)


def _measure(defs: Path, work: Path, changes, *, agent: str, seed: Path | None,
             daemon) -> dict:
    layered, chain = work / "layered", work / "per-instance"
    if layered.exists():
        shutil.rmtree(layered)
    shutil.copytree(defs, layered, ignore=shutil.ignore_patterns("__pycache__"))
    stores = {"envbuild": work / "store-envbuild", "per-instance": work / "store-per-instance"}
    node = Path(os.environ.get("ENVBUILD_NODE_CACHE") or work / "node")
    log = work / "build.log"
    trees = {"envbuild": layered, "per-instance": chain}
    chains = write_chain_tree(layered, chain, agent)
    result: dict = {"tasks": len(chains), "initial": {}, "changes": []}
    for scheme, tree in trees.items():
        result["initial"][scheme] = build(tree, stores[scheme], node, seed, log)
    previous = {s: result["initial"][s]["locks"] for s in trees}
    ids: dict[str, str] = {}
    if daemon is not None:  # the per-instance chain again, as Dockerfiles, by docker build
        result["initial"]["docker"] = r = docker_build(daemon, chain, stores["envbuild"],
                                                       work, log, ids)
        ids = r.pop("ids")
    for label, rel, old, new in changes:
        _apply(layered, rel, old, new)
        write_chain_tree(layered, chain, agent)
        row: dict = {"change": label}
        for scheme, tree in trees.items():
            r = build(tree, stores[scheme], node, None, log)
            r["relocked"] = sorted(e for e, d in r["locks"].items() if previous[scheme].get(e) != d)
            previous[scheme] = r.pop("locks")
            row[scheme] = r
        if daemon is not None:
            row["docker"] = r = docker_build(daemon, chain, stores["envbuild"], work, log, ids)
            ids = r.pop("ids")
        result["changes"].append(row)
    for scheme in trees:
        result["initial"][scheme].pop("locks", None)
    return result


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def render(result: dict) -> str:
    """The measurements as a text table (what the script prints without ``--json``)."""
    lines = [f"{result['tasks']} tasks. Per change and scheme: layers rebuilt, envs re-locked, "
             "layer bytes built (what docker build would write and push) / bytes the "
             "content-addressed store gained, wall seconds",
             f"{'change':<36} | {'envbuild':^44} | {'per-instance images':^44} | "
             "per-instance builds"]
    for row in result["changes"]:
        e, p = row["envbuild"], row["per-instance"]
        extra = (f"{len(p['built']) / max(1, len(e['built'])):.0f}x the layers, "
                 f"+{_size(max(0, p['built_bytes'] - e['built_bytes']))}")
        cells = [f"{len(r['built']):>3} layers {len(r['relocked']):>2} envs "
                 f"{_size(r['built_bytes']):>9} / {_size(r['bytes']):>8} {r['seconds']:>6.1f}s"
                 for r in (e, p)]
        lines.append(f"{row['change']:<36} | {cells[0]:<44} | {cells[1]:<44} | {extra}")
    for row in result["changes"]:
        lines.append(f"  {row['change']}: envbuild built {', '.join(row['envbuild']['built'])}; "
                     f"per-instance built {', '.join(row['per-instance']['built'])}")
    if "docker" in result["initial"]:
        d0 = result["initial"]["docker"]
        lines.append(f"docker build of the per-instance chain (--docker, same run): "
                     f"{d0['images']} images, {_size(d0['image_bytes'])} of layers, "
                     f"{d0['seconds']:.0f} s from an empty daemon")
        for row in result["changes"]:
            d = row["docker"]
            lines.append(f"  {row['change']}: docker rebuilt {len(d['built'])} images "
                         f"({_size(d['built_bytes'])} of new layers, {d['seconds']:.0f} s) vs "
                         f"envbuild {len(row['envbuild']['built'])} layer "
                         f"({_size(row['envbuild']['built_bytes'])})")
    i, last = result["initial"], (result["changes"] or [result["initial"]])[-1]
    lines.append(f"initial build: envbuild {len(i['envbuild']['built'])} layers built, "
                 f"per-instance {len(i['per-instance']['built'])} (layers already in "
                 "--seed-store are copied, not built)")
    lines.append(f"stores after the changes: envbuild {_size(last['envbuild']['store_bytes'])}, "
                 f"per-instance {_size(last['per-instance']['store_bytes'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--defs", type=Path, default=HERE, help="the layered tree (default: here)")
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch dir for both trees and stores (default: a new temp dir)")
    ap.add_argument("--seed-store", type=Path, default=None,
                    help="a store to take already-built layers from for the initial builds "
                         "(default: the repository's cache/ if it exists)")
    ap.add_argument("--agent", default="agent", help="the toolkit that is the agent layer")
    ap.add_argument("--change", action="append", nargs=4, metavar=("LABEL", "FILE", "OLD", "NEW"),
                    help="a change: replace OLD by NEW in FILE (relative to the tree); "
                         "repeatable; default: agent, base, one repo version")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON")
    ap.add_argument("--docker", action="store_true",
                    help="also build the per-instance chain as Dockerfiles with docker build in "
                         "a throwaway private dockerd, and report its images and layer bytes")
    args = ap.parse_args(argv)
    seed = args.seed_store
    if seed is None and (REPO / "cache" / "blobs").is_dir():
        seed = REPO / "cache"
    listed = args.defs / "sdists.txt"  # the example's own tree: its sdists must be fetched
    if listed.is_file():
        for line in listed.read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, version = line.split()[0].partition("==")
                if not (args.defs / "sdists" / f"{name}-{version}.tar.gz").is_file():
                    raise SystemExit(f"sdists/{name}-{version}.tar.gz is missing: run "
                                     f"{args.defs / 'fetch-sdists.sh'} first")
    work = args.work or Path(tempfile.mkdtemp(prefix="envbuild-swe-counts-"))
    work.mkdir(parents=True, exist_ok=True)
    result = measure(args.defs.resolve(), work.resolve(),
                     [tuple(c) for c in args.change] if args.change else DEFAULT_CHANGES,
                     agent=args.agent, seed=seed, docker=args.docker)
    result["work"] = str(work)
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
