"""The pure parts of the registry store: URL syntax, plain-HTTP rule, the ref/record → tag rule
(reversible, disjoint, within the tag grammar), auth files and challenges."""

from __future__ import annotations

import base64
import json
import random
import re
import string

import pytest

from envbuild.errors import SettingsError, StoreError
from envbuild.settings import Settings
from envbuild.store.registry import (
    RegistryURL,
    auth_files,
    find_credentials,
    parse_challenge,
    parse_url,
    plain_http,
    record_to_tag,
    ref_to_tag,
    tag_to_record,
    tag_to_ref,
)

TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def test_parse_url():
    assert parse_url("docker://127.0.0.1:5000/team/envs") == RegistryURL("127.0.0.1:5000",
                                                                         "team/envs")
    assert parse_url("docker://Registry.Example.com/a").host == "registry.example.com"
    assert parse_url("docker://localhost/a-b_c.d/e").hostname == "localhost"


@pytest.mark.parametrize("bad", ["docker://", "docker://host", "docker://host/", "s3://b/p",
                                 "docker://host/Upper", "docker://host/a//b",
                                 "docker://host:99999/a", "docker://host/-a"])
def test_bad_urls(bad):
    with pytest.raises(SettingsError):
        parse_url(bad)


@pytest.mark.parametrize("url", ["docker://host/repo:tag", "docker://host/repo@sha256:" + "0" * 64])
def test_url_with_a_tag_says_why(url):
    with pytest.raises(SettingsError, match="names a tag or digest") as e:
        parse_url(url)
    assert "env/NAME is the tag NAME" in e.value.hint


@pytest.mark.parametrize(("host", "insecure", "plain"), [
    ("127.0.0.1", (), True), ("127.5.6.7", (), True), ("localhost", (), True),
    ("[::1]", (), True), ("10.0.0.1", (), False), ("registry.example.com", (), False),
    ("registry.lan", ("registry.lan",), True), ("registry.lan", ("registry.lan:5000",), True),
    ("registry.lan", ("other.lan",), False),
])
def test_plain_http(host, insecure, plain):
    assert plain_http(host, insecure) is plain


def test_insecure_hosts_from_the_environment():
    s = Settings.from_env({"ENVBUILD_REGISTRY_INSECURE": "a.lan, b.lan:5000,,"})
    assert s.registry_insecure == ("a.lan", "b.lan:5000")
    assert Settings.from_env({}).registry_insecure == ()


@pytest.mark.parametrize(("ref", "tag"), [
    ("env/busybox-shell", "busybox-shell"),
    ("env/py3.11", "py3.11"),
    ("env/with_underscore", "envbuild-ref-env_swith__underscore"),
    ("env/envbuild-key-x", "envbuild-ref-env_senvbuild-key-x"),
    ("env/sha256-abc", "envbuild-ref-env_ssha256-abc"),
    ("snap/a/b", "envbuild-ref-snap_sa_sb"),
    ("base:2024-06", "envbuild-ref-base_c2024-06"),
    ("r", "envbuild-ref-r"),
    ("a@b+c", "envbuild-ref-a_ab_pc"),
])
def test_ref_tags(ref, tag):
    assert ref_to_tag(ref) == tag
    assert tag_to_ref(tag) == ref
    assert tag_to_record(tag) is None


def test_record_tags():
    key = "ab" * 32
    assert record_to_tag("keys/v1", key) == "envbuild-key-" + key
    assert tag_to_record("envbuild-key-" + key) == ("keys/v1", key)
    assert record_to_tag("keys/v1", "abc") == "envbuild-rec-keys_sv1_nabc"
    assert record_to_tag("lazy-profiles", "x_y") == "envbuild-rec-lazy-profiles_nx__y"
    for ns, name in [("keys/v1", "abc"), ("lazy-profiles", "x_y"), ("a_b/c", "d.e-f")]:
        tag = record_to_tag(ns, name)
        assert TAG.fullmatch(tag)
        assert tag_to_record(tag) == (ns, name)
        assert tag_to_ref(tag) is None


@pytest.mark.parametrize("tag", ["latest-but-sha256-", "sha256-" + "0" * 64, "sha256-x.sig",
                                 "envbuild-key-short", "envbuild-ref-bad_x", "envbuild-rec-ns",
                                 "envbuild-ref-env_sbusybox", "_x", "envbuild-other"])
def test_foreign_or_noncanonical_tags_do_not_decode(tag):
    # "envbuild-ref-env_sbusybox" would decode to env/busybox, whose tag is "busybox": only
    # the canonical encoding counts, so no two tags name the same ref
    got = tag_to_ref(tag)
    assert got is None or ref_to_tag(got) == tag
    rec = tag_to_record(tag)
    assert rec is None or record_to_tag(*rec) == tag


def test_the_rule_is_reversible_and_disjoint_on_random_names():
    rnd = random.Random(16)
    alnum = string.ascii_letters + string.digits
    seen: dict[str, object] = {}
    for _ in range(3000):
        parts = ["".join(rnd.choice(alnum) for _ in range(rnd.randint(1, 6)))
                 for _ in range(rnd.randint(1, 4))]
        name = parts[0]
        for p in parts[1:]:
            name += rnd.choice(["-", ".", "_", ":", "@", "+", "--", "/"]) + p
        if rnd.random() < 0.4:
            name = "env/" + name
        try:
            tag = ref_to_tag(name)
        except StoreError:
            continue  # not a valid ref name, or too long for a tag
        assert TAG.fullmatch(tag), (name, tag)
        assert tag_to_ref(tag) == name
        assert seen.setdefault(tag, name) == name
        ns = rnd.choice(["keys/v1", "lazy-profiles", "a_b/c.d"])
        rec = name.replace("/", ".").replace(":", "-").replace("@", "-").replace("+", "-")
        try:
            rtag = record_to_tag(ns, rec)
        except StoreError:
            continue
        assert TAG.fullmatch(rtag)
        assert tag_to_record(rtag) == (ns, rec)
        assert seen.setdefault(rtag, (ns, rec)) == (ns, rec)


def test_too_long_for_a_tag_is_refused_by_name():
    with pytest.raises(StoreError, match="too long for a registry tag") as e:
        ref_to_tag("snap/" + "x" * 120)
    assert e.value.reference == "invalid-name"


def test_auth_pathsorder(tmp_path):
    env = {"REGISTRY_AUTH_FILE": "/a.json", "XDG_RUNTIME_DIR": "/run/u", "HOME": "/home/u"}
    assert [str(p) for p in auth_files(env)] == [
        "/a.json", "/run/u/containers/auth.json", "/home/u/.docker/config.json"]
    assert [str(p) for p in auth_files({"DOCKER_CONFIG": "/d"})] == ["/d/config.json"]


def test_find_credentials(tmp_path):
    url = parse_url("docker://reg.example:5000/team/envs")
    enc = base64.b64encode(b"alice:pa:ss").decode()
    podman = tmp_path / "auth.json"
    podman.write_text(json.dumps({"auths": {"reg.example:5000/team": {"auth": enc}}}))
    docker = tmp_path / "config.json"
    docker.write_text(json.dumps({"auths": {"https://reg.example:5000/v1/": {
        "username": "bob", "password": "pw"}}}))
    assert find_credentials(url, [podman, docker]) == ("alice", "pa:ss")  # per-repo, first file
    assert find_credentials(url, [tmp_path / "absent.json", docker]) == ("bob", "pw")
    other = parse_url("docker://other.example/x")
    assert find_credentials(other, [podman, docker]) is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"auths": []}),
                                     json.dumps({"auths": {"h": {"auth": "bm9jb2xvbg=="}}})])
def test_bad_auth_file_names_itself(tmp_path, content):
    path = tmp_path / "auth.json"
    path.write_text(content)
    with pytest.raises(SettingsError) as e:
        find_credentials(parse_url("docker://h/x"), [path])
    assert str(path) in e.value.message


def test_parse_challenge():
    scheme, params = parse_challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:team/envs:pull,push"')
    assert scheme == "bearer"
    assert params == {"realm": "https://auth.example/token", "service": "registry.example",
                      "scope": "repository:team/envs:pull,push"}
    assert parse_challenge('Basic realm="envbuild-test"') == ("basic", {"realm": "envbuild-test"})
