"""Registry credentials and challenges (pure: files in, values out; no network).

Credentials come from ``$REGISTRY_AUTH_FILE`` (podman's ``auth.json``), else
``$XDG_RUNTIME_DIR/containers/auth.json``, else ``$DOCKER_CONFIG/config.json`` /
``~/.docker/config.json`` — the ``auths`` entry for ``HOST[:PORT]/REPO`` or ``HOST[:PORT]``
(``auth`` = base64 ``user:password``, or ``username``/``password``). Credential helpers
(``credsStore``) are not run. The ``401`` dance that uses them is ``RegistryClient``'s
(``envbuild.store._registry_http``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from envbuild.errors import SettingsError
from envbuild.store._registry_format import RegistryURL


def auth_files(environ: Mapping[str, str]) -> list[Path]:
    """Where credentials are looked for, in order (podman's order, then Docker's)."""
    out = []
    if environ.get("REGISTRY_AUTH_FILE"):
        out.append(Path(environ["REGISTRY_AUTH_FILE"]))
    if environ.get("XDG_RUNTIME_DIR"):
        out.append(Path(environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    docker_dir = environ.get("DOCKER_CONFIG") or (
        str(Path(environ["HOME"]) / ".docker") if environ.get("HOME") else None)
    if docker_dir:
        out.append(Path(docker_dir) / "config.json")
    return out


def find_credentials(url: RegistryURL, files: Iterable[Path]) -> tuple[str, str] | None:
    """``(user, password)`` for ``url`` from the first auth file that has an entry for
    ``HOST/REPO`` (or a parent path), ``HOST``, or ``https://HOST[/v1/]``; ``None`` if none.
    A file that exists but cannot be parsed is a ``SettingsError`` naming it."""
    parts = url.repo.split("/")
    keys = [f"{url.host}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)]
    keys += [url.host, f"https://{url.host}", f"https://{url.host}/v1/",
             f"http://{url.host}", f"https://{url.host}/v2/"]
    for path in files:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SettingsError(f"read registry credentials {path}: {e.strerror}") from None
        try:
            auths = json.loads(data).get("auths", {})
            if auths is None:
                auths = {}
            if not isinstance(auths, dict):
                raise ValueError("'auths' is not an object")
        except (ValueError, AttributeError) as e:
            raise SettingsError(f"parse registry credentials {path}: {e}",
                                hint="it must be JSON like {\"auths\": {\"HOST\": {\"auth\": "
                                     "\"base64(user:password)\"}}}") from None
        for key in keys:
            entry = auths.get(key)
            if not isinstance(entry, dict):
                continue
            if entry.get("auth"):
                try:
                    user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
                except (binascii.Error, UnicodeDecodeError, TypeError):
                    sep = ""
                if not sep:
                    raise SettingsError(f"bad 'auth' for {key} in {path}",
                                        hint="it must be base64 of 'user:password'")
                return user, password
            if entry.get("username") and entry.get("password") is not None:
                return str(entry["username"]), str(entry["password"])
    return None


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…",scope="…"`` (a ``WWW-Authenticate`` value) →
    ``("bearer", {"realm": …, "service": …, "scope": …})``."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in re.finditer(r'([A-Za-z_]+)\s*=\s*(?:"([^"]*)"|([^,\s]*))', rest)}
    return scheme.lower(), params
