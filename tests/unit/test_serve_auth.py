"""``envbuild.serve.auth``: the API key file (plain and ``sha256:`` lines, comments, bad
lines) and token comparison; ``envbuild serve`` listens on loopback unless told otherwise."""

from __future__ import annotations

import hashlib

import pytest

from envbuild.errors import SettingsError
from envbuild.serve.auth import ApiKeys, new_token, same_token


def test_plain_and_hashed_keys_are_accepted_and_nothing_else():
    keys = ApiKeys.parse(f"# comment\n\nplain-key\nsha256:{hashlib.sha256(b'hashed').hexdigest()}\n")
    assert keys.accepts("plain-key") and keys.accepts("hashed")
    for wrong in (None, "", "plain-ke", "plain-key ", "HASHED",
                  f"sha256:{hashlib.sha256(b'hashed').hexdigest()}",
                  hashlib.sha256(b"hashed").hexdigest()):
        assert not keys.accepts(wrong), wrong


@pytest.mark.parametrize("text", ["", "# only a comment\n", "sha256:abc\n", "sha256:" + "g" * 64])
def test_a_key_file_without_a_usable_key_is_refused(text):
    with pytest.raises(SettingsError) as e:
        ApiKeys.parse(text, "keys.txt")
    assert e.value.message.startswith("keys.txt") and e.value.hint


def test_a_missing_key_file_is_one_clear_error(tmp_path):
    with pytest.raises(SettingsError, match="read API key file"):
        ApiKeys.from_file(tmp_path / "nope")


def test_tokens_are_random_and_compared_whole():
    a, b = new_token(), new_token()
    assert a != b and len(a) >= 40
    assert same_token(a, a) and not same_token(b, a) and not same_token(None, a)
    assert not same_token(a[:-1], a) and not same_token("", a)


def test_serve_listens_on_loopback_by_default():
    from envbuild.cli.cmd_serve import _listen, serve
    from envbuild.serve import ServeOptions

    listen = next(p for p in serve.params if p.name == "listen")
    assert _listen(listen.default)[0] == "127.0.0.1"
    assert ServeOptions.__dataclass_fields__["host"].default == "127.0.0.1"
    with pytest.raises(SettingsError):
        _listen("nonsense")
