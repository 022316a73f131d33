"""Dockerfile bases: ``from: {dockerfile: {context, file, args, target, network}}`` (issue 17).

Two halves, as for every source: **pinning** (``envbuild.build.dockerpin``, no daemon: the
context digest, the Dockerfile's sha256, each ``FROM`` digest; the Dockerfile itself is read
and parsed by ``envbuild.defs.dockerfile``) and **building**, here (side effects).

``build_dockerfile``: the Dockerfile bytes are read again and must
still hash to their pin; they are written to the build's scratch dir and given to
``docker build`` (``DOCKER_BUILDKIT=1``, ``--progress=plain``, ``--network``, ``--build-arg``\\ s,
``--target``, ``--iidfile``; with ``network: host`` the host's CA bundle as the secret
``envbuild-host-ca``, ``HOST_CA_SECRET``) with the context directory, against ``envbuild.dockerd``'s daemon
(a private dockerd under the node cache, stopped and removed when the build ends, or the user's
at ``DOCKER_HOST``). Debian's dockerd 20.10 has no ``oci`` exporter (``exporter "oci" could not
be found``), so the image leaves the daemon by ``docker save`` into the scratch dir (the layer's
capped disk). Its ``manifest.json`` and config are read bounded, each layer's sha256 is checked
against the config's ``rootfs.diff_ids`` while it streams through the one safe unpacker
(``envbuild.layers._unpack.unpack_tar``, whiteouts applied, as for ``oci`` bases), and the
config's ``Env``/``WorkingDir``/``User``/``Cmd`` are kept. A failing build raises
``BuildError`` with its last output line as the cause and the output tail as context.

The names of the two other halves are re-exported here (``from_images``, ``pin_dockerfile``, …)
for callers that import them from this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from envbuild.build import buildlog
from envbuild.build.dockerpin import (  # noqa: F401  (re-exported)
    CONTEXT_TAG,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    DockerIgnore,
    context_digest,
    env_limit,
    pin_dockerfile,
    pin_from,
)
from envbuild.build.importers import Imported, run_tool
from envbuild.defs.confine import Unpinnable
from envbuild.defs.dockerfile import (  # noqa: F401  (re-exported)
    ENV_PIN_PREFIX,
    ENV_REF_RE,
    LOCK_HOST,
    LOCK_REF_RE,
    MAX_DOCKERFILE_BYTES,
    env_upstreams,
    from_images,
    locate,
    logical_lines,
    read_small,
)
from envbuild.errors import BuildError, SourceError
from envbuild.oci import is_digest

OUTPUT_TAIL_LINES = 30
DEFAULT_BUILD_TIMEOUT = 3 * 3600

#: the BuildKit secret id of the host's CA bundle, given to ``network: host`` builds: the host
#: may reach PyPI & co. only through an intercepting proxy that bundle trusts (envbuild's own
#: network steps get it bound in); a RUN takes it with
#: ``--mount=type=secret,id=envbuild-host-ca,target=/etc/ssl/certs/ca-certificates.crt``
HOST_CA_SECRET = "envbuild-host-ca"


# ----------------------------------------------------------------------------- building


def build_dockerfile(src, name: str, base_dir: Path, pins: Mapping[str, str], dest: Path,
                     scratch: Path, daemon_root: Path, log: Path,
                     cancelled: threading.Event | None = None, store=None):
    """Build the Dockerfile base ``src`` and unpack its image into ``dest``; returns the
    image's config as ``importers.Imported``."""
    from envbuild.dockerd import docker_daemon

    context, text = _pinned_dockerfile(src, name, base_dir, pins)
    scratch.mkdir(parents=True, exist_ok=True)
    locks = _lock_archives(text, src, name, store, scratch)
    locks += _prefetch(text, src, name, scratch, daemon_root, len(locks), cancelled)
    for i, (ref, _archive) in enumerate(locks):
        # whole references only: envbuild.invalid/env/a is a prefix of .../env/a@sha256:… and
        # of .../env/ab
        tag = _lock_tag(scratch, i)
        text = re.sub(re.escape(ref) + r"(?![A-Za-z0-9._@:/-])", tag, text)  # no backslash in a tag
    (scratch / "Dockerfile").write_text(text)
    image = scratch / "image.tar"
    t0 = time.monotonic()
    # network: host means egress, not the host (as for envbuild's own run steps): a private
    # daemon runs in a namespace of its own behind slirp4netns for it
    # Its data root (images, BuildKit's cache, what RUN steps write) is on the layer's capped
    # scratch disk, as the rest of the build's writes: a RUN step meets ENOSPC at the cap.
    with docker_daemon(daemon_root, egress_only=src.network == "host",
                       data_root=scratch / "daemon-data") as d:
        _note(log, f"daemon ready in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        for i, (ref, archive) in enumerate(locks):
            _load_lock(d, ref, archive, _lock_tag(scratch, i), cancelled)
        image_id = _docker_build(d, src, name, context, scratch, log, cancelled)
        t1 = time.monotonic()
        _note(log, f"docker build took {t1 - t0:.1f} s")
        _save(d, image_id, image, [_lock_tag(scratch, i) for i in range(len(locks))], cancelled)
        t2 = time.monotonic()
        _note(log, f"docker save took {t2 - t1:.1f} s")
    t3 = time.monotonic()
    _note(log, f"daemon stopped and removed in {t3 - t2:.1f} s")
    imported = import_docker_archive(image, dest, f"{name}: image")
    _note(log, f"image unpacked in {time.monotonic() - t3:.1f} s")
    return imported


def _pinned_dockerfile(src, name: str, base_dir: Path, pins: Mapping[str, str]
                       ) -> tuple[str, str]:
    """(the context dir, the Dockerfile's text), read again and checked against its pin."""
    try:
        context, dockerfile = locate(src, str(base_dir), None)
        text = read_small(dockerfile)
    except (Unpinnable, OSError) as e:
        raise SourceError(f"{name}: {getattr(e, 'message', None) or e}") from None
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    if pins.get("source.dockerfile") not in (None, digest):
        raise SourceError(f"{name}: {src.file} changed since it was planned",
                          hint="run the build again (it re-plans)")
    return context, text


def _docker_build(d, src, name: str, context: str, scratch: Path, log: Path,
                  cancelled: threading.Event | None) -> str:
    """Run ``docker build`` of ``scratch/Dockerfile`` against the daemon ``d``, its output to
    ``log``, bounded in time; returns the image id."""
    iid = scratch / "iid"
    argv = [d.cli, "build", "--progress=plain", f"--network={src.network}",
            "--iidfile", str(iid), "-f", str(scratch / "Dockerfile")]
    if src.network == "host":
        from runtime_shim.isolation import host_ca_bundle

        ca = host_ca_bundle()
        if ca is not None:  # a secret: never in the image, never in the build cache key
            argv += ["--secret", f"id={HOST_CA_SECRET},src={ca}"]
    for k, v in src.args:
        argv += ["--build-arg", f"{k}={v}"]
    if src.target:
        argv += ["--target", src.target]
    argv += ["--", context]
    _note(log, f"{name}: docker build ({'private dockerd' if d.private else d.host})")
    limit = env_limit("ENVBUILD_DOCKER_BUILD_TIMEOUT", DEFAULT_BUILD_TIMEOUT)
    stop = _deadline(cancelled, limit)
    try:
        code = _run_logged(argv, d.env(), log, stop)
    finally:
        stop.set()  # ends the watcher
    if code is None:
        if cancelled is not None and cancelled.is_set():
            raise BuildError(f"{name}: cancelled", hint="nothing was published for this layer")
        raise BuildError(f"{name}: docker build timed out after {limit} s",
                         context=_build_failed(name, log, src.network).context,
                         hint="raise ENVBUILD_DOCKER_BUILD_TIMEOUT if the build is meant to "
                              "take that long")
    if code != 0:
        raise _build_failed(name, log, src.network)
    image_id = iid.read_text().strip()
    if not is_digest(image_id):
        raise BuildError(f"{name}: docker build wrote no image id ({image_id[:80]!r})")
    return image_id


def _save(d, image_id: str, image: Path, tags: list[str], cancelled) -> None:
    """``docker save`` the image into ``image``; then, in the user's daemon, remove it and the
    lock ``tags`` (its cache stays)."""
    try:
        run_tool([d.cli, "save", "-o", str(image), "--", image_id], "docker save",
                 cancelled=cancelled, env=d.env())
    finally:
        if not d.private:  # leave no image behind in the user's daemon (its cache stays)
            for ref in [image_id, *tags]:
                subprocess.run([d.cli, "image", "rm", "--", ref], env=d.env(),
                               capture_output=True, stdin=subprocess.DEVNULL, timeout=60,
                               check=False)


def _note(log: Path, text: str) -> None:
    with open(log, "ab") as out:
        out.write(f"=== {text}\n".encode())


def _run_logged(argv: list[str], env: Mapping[str, str], log: Path,
                stop: threading.Event) -> int | None:
    """Run ``argv`` with its output appended to ``log``, which keeps its head and tail past
    ``BUILD_LOG_CAP`` (a build's output is untrusted and the log is on the host, outside any
    capped disk). Returns the exit code, or None when ``stop`` was set first (its process
    group killed)."""
    from runtime_shim.isolation import copy_capped

    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=write_fd,
                                stderr=write_fd, env=dict(env), start_new_session=True)
    except OSError as e:
        os.close(read_fd)
        raise BuildError(f"run {argv[0]}: {e.strerror or e}",
                         hint="apt-get install docker.io (scripts/setup.sh)") from None
    finally:
        os.close(write_fd)
    copier = threading.Thread(target=copy_capped,
                              args=(read_fd, buildlog.CappedLog(log, buildlog.BUILD_LOG_CAP), sys.maxsize),
                              daemon=True)
    copier.start()
    try:
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                if stop.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        copier.join(timeout=30)


def _deadline(cancelled: threading.Event | None, seconds: int) -> threading.Event:
    """An event set when ``cancelled`` is (Ctrl-C of the build) or ``seconds`` have passed."""
    ev = threading.Event()

    def watch() -> None:
        end = time.monotonic() + seconds
        while not ev.is_set():
            if (cancelled is not None and cancelled.is_set()) or time.monotonic() > end:
                ev.set()
                return
            ev.wait(0.1)

    threading.Thread(target=watch, daemon=True).start()
    return ev


def _lock_tag(scratch: Path, i: int) -> str:
    # unique per build: two builds sharing a user's daemon never see each other's tags
    return f"envbuild-from/{hashlib.sha256(str(scratch).encode()).hexdigest()[:12]}:{i}"


def _lock_archives(text: str, src, name: str, store, scratch: Path) -> list[tuple[str, Path]]:
    """``(reference, docker-archive)`` of every ``FROM envbuild.invalid/env/NAME@DIGEST``: the
    lock exported from the store (plain tar layers), checked to be the pinned digest."""
    from envbuild.export import ExportRequest, ExportTarget, export_lock

    out: list[tuple[str, Path]] = []
    for ref in dict.fromkeys(from_images(text, dict(src.args))):
        m = LOCK_REF_RE.fullmatch(ref)
        env = ENV_REF_RE.fullmatch(ref)
        if m is None and env is None:
            continue
        if ref not in text:
            raise SourceError(f"{name}: FROM {ref} must be written literally (not built from "
                              "ARGs) to be served from the envbuild store")
        if store is None:
            raise BuildError(f"{name}: FROM {ref} needs the envbuild store")
        from envbuild.errors import RefNotFound

        lock_ref = m.group(1) if m is not None else f"env/{env.group(1)}"  # type: ignore[union-attr]
        try:
            now = store.get_ref(lock_ref).digest
        except RefNotFound:
            raise SourceError(f"{name}: FROM {ref}: the store has no lock {lock_ref}",
                              hint=f"build it first: envbuild build {lock_ref[4:]}") from None
        # an in-tree env (no digest) is whatever it is locked at now: the engine locks it just
        # before this build, from the layers this plan keyed (``engine.build``)
        digest = m.group(2) if m is not None else now
        if now != digest:
            raise SourceError(f"{name}: FROM {ref}: {lock_ref} is locked at {now}, not {digest}",
                              hint=f"write {LOCK_HOST}/{lock_ref}@{now} to build on the "
                                   "current lock")
        archive = scratch / f"from-{len(out)}.tar"
        export_lock(store, ExportRequest(ref=lock_ref, target=ExportTarget(
            "docker-archive", archive, _lock_tag(scratch, len(out))), compression="none"))
        out.append((ref, archive))
    return out


def _prefetch(text: str, src, name: str, scratch: Path, daemon_root: Path, first: int,
              cancelled) -> list[tuple[str, Path]]:
    """``network: host`` puts the private daemon behind slirp4netns, where the host's
    loopback (a local registry) is out of reach: the ``FROM`` images of registries are pulled
    first by a daemon in the host's namespace (that daemon runs no build step) and saved,
    then loaded into the build's daemon like locks. Nothing to do for ``network: none`` or
    with ``DOCKER_HOST``."""
    from envbuild.dockerd import docker_daemon

    if src.network != "host" or os.environ.get("DOCKER_HOST", "").strip():
        return []
    refs = [r for r in dict.fromkeys(from_images(text, dict(src.args)))
            if not LOCK_REF_RE.fullmatch(r) and not ENV_REF_RE.fullmatch(r)]
    if not refs:
        return []
    for ref in refs:
        if ref not in text:
            raise SourceError(f"{name}: FROM {ref} must be written literally (not built from "
                              "ARGs) with network: host")
    out: list[tuple[str, Path]] = []
    with docker_daemon(daemon_root, data_root=scratch / "prefetch-data") as pre:
        for ref in refs:
            tag = _lock_tag(scratch, first + len(out))
            archive = scratch / f"from-{first + len(out)}.tar"
            for argv in (["pull", "-q", "--", ref], ["tag", "--", ref, tag],
                         ["save", "-o", str(archive), "--", tag]):
                run_tool([pre.cli, *argv], f"docker {argv[0]} of {ref}", cancelled=cancelled,
                     env=pre.env())
            out.append((ref, archive))
    return out


def _load_lock(d, ref: str, archive: Path, tag: str, cancelled) -> None:
    run_tool([d.cli, "load", "-q", "-i", str(archive)], f"docker load of {ref}",
         cancelled=cancelled, env=d.env())


#: How TLS clients (pip/requests/urllib3, curl, git, Go, OpenSSL, apt) say they did not trust
#: a server's certificate: here, the host's intercepting proxy without the host's CA bundle.
_UNTRUSTED_CERT_RE = re.compile(
    r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSL certificate problem"
    r"|x509: certificate signed by unknown authority|server certificate verification failed"
    r"|unable to get local issuer certificate|self[- ]signed certificate in certificate chain",
    re.IGNORECASE)


def ca_secret_hint(output: str, network: str) -> str | None:
    """The hint for a Dockerfile build whose output shows a TLS client that did not trust a
    certificate, else None: a ``RUN`` that downloads must mount the host's CA bundle (the
    secret ``HOST_CA_SECRET``, given with ``network: host`` only), and a secret is mounted
    only in the ``RUN`` that names it."""
    if not _UNTRUSTED_CERT_RE.search(output):
        return None
    target = "/etc/ssl/certs/ca-certificates.crt"
    mount = f"RUN --mount=type=secret,id={HOST_CA_SECRET},target={target}"
    if network != "host":
        return (f"a download did not trust its server's certificate: set network: host, whose "
                f"builds get the host's CA bundle as the secret {HOST_CA_SECRET}, and mount it "
                f"in every RUN that downloads ({mount} pip install …)")
    return (f"a download did not trust its server's certificate: this host reaches the network "
            f"through a proxy only its CA bundle trusts, given to the build as the secret "
            f"{HOST_CA_SECRET}, and a secret is mounted only in the RUN that names it: write "
            f"{mount} … in every RUN that downloads (pip: also PIP_CERT={target}; other "
            f"clients: SSL_CERT_FILE={target})")


def _build_failed(name: str, log: Path, network: str = "none") -> BuildError:
    with open(log, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 256 * 1024))
        lines = f.read().decode(errors="replace").splitlines()
    tail = lines[-OUTPUT_TAIL_LINES:]
    cause = next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
    cause = re.sub(r"^#\d+ (\d+\.\d+ )?", "", cause)
    if len(cause) > 300:
        cause = cause[:300] + "…"
    hint = f"full log: {log}; nothing was published"
    ca = ca_secret_hint("\n".join(lines), network)
    return BuildError(f"{name}: docker build failed: {cause}", context="\n".join(tail),
                      hint=f"{ca}; {hint}" if ca else hint)


class _Hashing:
    """A reader that hashes what passes through it."""

    def __init__(self, f) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.h.update(memoryview(b)[:n])
        return n


def import_docker_archive(path: Path, dest: Path, what: str):
    """Unpack the single image of a ``docker save`` archive into ``dest`` (layers checked
    against the config's diff_ids); returns its config as ``importers.Imported``."""
    from envbuild.canonical import load_json
    from envbuild.layers import unpack_tar

    def member_json(tar: tarfile.TarFile, member: str):
        try:
            f = tar.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise BuildError(f"{what}: {member} is missing from the saved image")
        data = f.read((4 << 20) + 1)
        try:
            return load_json(data, max_bytes=4 << 20)
        except ValueError as e:
            raise BuildError(f"{what}: {member} is not valid JSON ({e})") from None

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "r:") as tar:
        manifest = member_json(tar, "manifest.json")
        if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
            raise BuildError(f"{what}: manifest.json does not describe one image")
        config_doc = member_json(tar, str(manifest[0].get("Config")))
        layers = manifest[0].get("Layers") or []
        diff_ids = (config_doc.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layers):
            raise BuildError(f"{what}: {len(layers)} layers but {len(diff_ids)} diff_ids")
        for member, diff_id in zip(layers, diff_ids):
            f = tar.extractfile(str(member)) if member in tar.getnames() else None
            if f is None:
                raise BuildError(f"{what}: layer {member} is missing from the saved image")
            reader = _Hashing(f)
            unpack_tar(reader, dest, name=f"{what} layer {str(diff_id)[:19]}", whiteouts="apply")
            while reader.read(1 << 20):
                pass
            if "sha256:" + reader.h.hexdigest() != diff_id:
                raise BuildError(f"{what}: layer {member} does not hash to its diff_id {diff_id}")
    config = config_doc.get("config") or {}
    env = dict(str(item).partition("=")[::2] for item in config.get("Env") or [])
    cmd = config.get("Cmd")
    return Imported(env=env, workdir=config.get("WorkingDir") or None,
                    user=config.get("User") or None, cmd=tuple(cmd) if cmd else None)
