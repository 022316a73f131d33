"""Dockerfile bases without a daemon (issue 17): FROM parsing, .dockerignore rules, the context
digest, and which changes move the layer key."""

from __future__ import annotations

import os
import textwrap

import pytest

from envbuild.build.dockerfile import (
    DockerIgnore,
    Unpinnable,
    context_digest,
    from_images,
    logical_lines,
    pin_from,
)

D = "sha256:" + "ab" * 32


def test_from_images_skips_scratch_and_stages_and_expands_args():
    text = textwrap.dedent(f"""\
        # syntax comment
        ARG REG=reg.example:5000
        ARG TAG
        FROM --platform=linux/amd64 $REG/base@{D} AS build
        RUN echo \\
            continued
        FROM scratch
        FROM build AS final
        FROM ${{REG}}/other:${{TAG:-v1}}@{D}
        """)
    assert from_images(text, {}) == [f"reg.example:5000/base@{D}", f"reg.example:5000/other:v1@{D}"]
    assert from_images(text, {"REG": "r2:1"})[0] == f"r2:1/base@{D}"


def test_logical_lines_join_continuations_and_honour_escape_directive():
    assert logical_lines("FROM a\nRUN x \\\n  # comment\n  y\n") == ["FROM a", "RUN x y"]
    assert logical_lines("# escape=`\nRUN a `\n b\n") == ["RUN a b"]


def test_from_with_undeclared_arg_is_refused():
    with pytest.raises(Unpinnable, match="does not expand"):
        from_images("FROM $NOPE\n", {})


def test_pin_from_takes_the_digest_and_refuses_a_hub_tag_with_the_form_to_write():
    assert pin_from(f"debian:bookworm@{D}") == D
    with pytest.raises(Unpinnable) as e:
        pin_from("debian:bookworm")
    assert "names a tag, not a digest" in e.value.message
    assert "debian:bookworm@sha256:<digest>" in e.value.hint


@pytest.mark.parametrize("patterns,path,excluded", [
    ("secret.txt", "secret.txt", True),
    ("secret.txt", "sub/secret.txt", False),
    ("*.log", "a.log", True),
    ("*.log", "d/a.log", False),
    ("**/*.log", "d/e/a.log", True),
    ("build", "build/x/y", True),          # a directory pattern covers what is below
    ("/build", "build", True),
    ("*\n!keep.txt", "keep.txt", False),  # the last matching pattern wins
    ("*\n!keep.txt", "other", True),
    ("d?t[0-9]", "dat5", True),
    ("# comment\n\n", "x", False),
])
def test_dockerignore_rules(patterns, path, excluded):
    assert DockerIgnore(patterns).excluded(path) is excluded


def test_context_digest_honours_dockerignore_and_sees_content_modes_and_links(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "ignored.log").write_text("1")
    (tmp_path / ".dockerignore").write_text("*.log\n")
    first = context_digest(str(tmp_path))
    (tmp_path / "ignored.log").write_text("2")
    assert context_digest(str(tmp_path)) == first
    (tmp_path / "a.txt").write_text("b")
    second = context_digest(str(tmp_path))
    assert second != first
    os.chmod(tmp_path / "a.txt", 0o755)
    third = context_digest(str(tmp_path))
    assert third != second
    os.symlink("/etc/passwd", tmp_path / "link")  # hashed as a link, never followed
    assert context_digest(str(tmp_path)) != third


def test_context_limits_refuse_before_reading(tmp_path, monkeypatch):
    with open(tmp_path / "big", "wb") as f:
        f.truncate(3 << 20)  # sparse: refused from stat, never read
    monkeypatch.setenv("ENVBUILD_DOCKER_CONTEXT_MAX_BYTES", str(1 << 20))
    with pytest.raises(Unpinnable, match="more than 1 MiB"):
        context_digest(str(tmp_path))
    monkeypatch.delenv("ENVBUILD_DOCKER_CONTEXT_MAX_BYTES")
    for i in range(20):
        (tmp_path / f"f{i}").write_text("")
    monkeypatch.setenv("ENVBUILD_DOCKER_CONTEXT_MAX_ENTRIES", "10")
    with pytest.raises(Unpinnable, match="more than 10 entries"):
        context_digest(str(tmp_path))


BASE = """\
apiVersion: envbuild/v1
kind: Base
name: dock
abi: dock-1
from:
  dockerfile:
    context: ctx
{extra}"""


def _key(defs, extra: str = "") -> str:
    from envbuild.build.pin import snapshot

    (defs / "base" / "dock.yaml").write_text(BASE.format(extra=extra))
    return snapshot(defs).keys.layers["dock"]


def test_layer_key_covers_dockerfile_context_args_target_network(tmp_path):
    defs = tmp_path / "envdefs"
    (defs / "base").mkdir(parents=True)
    ctx = defs / "base" / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM scratch AS one\nCOPY a /a\nFROM one AS two\n")
    (ctx / "a").write_text("a")
    (ctx / ".dockerignore").write_text("junk\n")
    k0 = _key(defs)
    assert _key(defs) == k0
    (ctx / "junk").write_text("x")
    assert _key(defs) == k0, "an ignored file must not change the key"
    keys = {k0}
    (ctx / "a").write_text("b")
    keys.add(_key(defs))
    (ctx / "Dockerfile").write_text("FROM scratch AS one\nCOPY a /b\nFROM one AS two\n")
    keys.add(_key(defs))
    keys.add(_key(defs, "    args: {X: '1'}\n"))
    keys.add(_key(defs, "    args: {X: '2'}\n"))
    keys.add(_key(defs, "    target: one\n"))
    keys.add(_key(defs, "    network: host\n"))
    assert len(keys) == 7


def test_from_tag_is_refused_at_planning_with_one_line(tmp_path):
    from envbuild.errors import SourceError

    defs = tmp_path / "envdefs"
    (defs / "base" / "ctx").mkdir(parents=True)
    (defs / "base" / "ctx" / "Dockerfile").write_text("FROM debian:bookworm\n")
    with pytest.raises(SourceError) as e:
        _key(defs)
    assert "\n" not in e.value.message
    assert "dock.yaml" in e.value.message and "names a tag, not a digest" in e.value.message
    assert "@sha256:" in e.value.hint


def test_layer_key_covers_every_from_digest(tmp_path):
    defs = tmp_path / "envdefs"
    (defs / "base" / "ctx").mkdir(parents=True)
    df = defs / "base" / "ctx" / "Dockerfile"
    keys = set()
    for a, b in (("1", "2"), ("1", "3"), ("4", "2")):
        df.write_text(f"FROM 127.0.0.1:5000/x@sha256:{a * 64} AS one\n"
                      f"FROM envbuild.invalid/env/y@sha256:{b * 64}\nCOPY --from=one / /\n")
        keys.add(_key(defs))
    assert len(keys) == 3


def test_copy_from_and_run_mount_from_images_must_be_pinned_too():
    text = (f"FROM scratch AS a\nCOPY --from=a /x /y\nCOPY --from=0 /x /y\n"
            f"COPY --chown=1:1 --from=reg.example/tools@{D} /t /t\n"
            f"RUN --mount=type=bind,from=reg.example/cache@{D},target=/c true\n"
            "COPY --from=busybox:latest /bin/busybox /bin/\n")
    assert from_images(text, {}) == [f"reg.example/tools@{D}", f"reg.example/cache@{D}",
                                     "busybox:latest"]
    with pytest.raises(Unpinnable, match="names a tag"):
        pin_from(from_images(text, {})[-1])


@pytest.mark.parametrize("line", ["ADD https://example.com/x.tgz /x",
                                  "ADD --chown=1:1 http://127.0.0.1:9000/secret /s",
                                  'ADD ["git@github.com:a/b.git", "/b"]',
                                  "ADD git://host/repo /r"])
def test_add_of_a_url_is_refused(line):
    with pytest.raises(Unpinnable, match="ADD of a URL"):
        from_images(f"FROM scratch\n{line}\n", {})


def test_add_of_local_files_is_fine():
    assert from_images("FROM scratch\nADD a.tar.gz /x\nADD --chown=1:1 b c /d/\n", {}) == []


def test_a_dockerfile_that_is_not_utf8_is_refused(tmp_path):
    from envbuild.errors import SourceError

    defs = tmp_path / "envdefs"
    (defs / "base" / "ctx").mkdir(parents=True)
    (defs / "base" / "ctx" / "Dockerfile").write_bytes(b"FROM scratch\nLABEL x=\xff\n")
    with pytest.raises(SourceError, match="Dockerfile is not UTF-8 text"):
        _key(defs)


def test_a_syntax_directive_is_refused():
    """``# syntax=`` makes BuildKit pull a frontend image (registry-1.docker.io here: "no such
    host"), a fetch the key does not cover; a comment that is not a directive is fine."""
    with pytest.raises(Unpinnable, match="frontend image") as e:
        from_images("# syntax=docker/dockerfile:1\nFROM scratch\n", {})
    assert "remove the line" in e.value.hint
    assert from_images("# a comment\n# syntax=docker/dockerfile:1\nFROM scratch\n", {}) == []


@pytest.mark.parametrize("output", [
    "SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify "
    "failed: self-signed certificate in certificate chain (_ssl.c:1006)'))",   # pip
    "curl: (60) SSL certificate problem: self-signed certificate in certificate chain",
    "fatal: unable to access 'https://github.com/x/y/': server certificate verification failed",
    "Get \"https://proxy.golang.org/\": x509: certificate signed by unknown authority",
])
def test_a_distrusted_certificate_gets_the_ca_secret_hint(output):
    from envbuild.build.dockerfile import ca_secret_hint

    hint = ca_secret_hint(f"#7 [2/3] RUN pip install six\n#7 1.2 {output}\n", "host")
    assert "RUN --mount=type=secret,id=envbuild-host-ca,target=/etc/ssl/certs/ca-certificates.crt" \
        in hint and "every RUN that downloads" in hint
    assert "network: host" in ca_secret_hint(output, "none")


def test_other_failures_get_no_ca_secret_hint():
    from envbuild.build.dockerfile import ca_secret_hint

    assert ca_secret_hint("#7 0.1 sh: make: not found\nexit code: 127", "host") is None
