"""The HTTP side of ``RegistryStore``: one client per store that sends requests to the
registry with retries, authentication, bounded answers and deadlines.

Auth: a ``401`` with a ``Basic`` challenge is answered with the credentials
(``envbuild.store._registry_auth``); with a ``Bearer`` challenge a token for the challenge's
scope is fetched from its realm (with the credentials, if any) and reused until the registry
asks again.

Failures: connection errors, ``429`` and ``5xx`` are retried ``attempts`` times with bounded
exponential backoff and jitter; a registry that stays down, refuses credentials (``401``) or
denies access (``403``) fails with one line naming the registry and a hint.

A registry is untrusted input (``envbuild.store._http_guard``): every answer read whole is
read with a limit (``MAX_RESPONSE``; a range its length), a declared ``Content-Length`` over
it refused before reading; every request, retries included, ends by ``deadline`` seconds (a
blob download gets one more second per ``MIN_RATE`` bytes), whatever the server dribbles;
redirects go only to the registry itself or a configured blob host
(``$ENVBUILD_REGISTRY_BLOB_HOSTS``), and any connection off the registry (a blob host, a
token realm) only to public addresses or to the registry's own, checked before connecting.
``Authorization`` is sent to the registry only (a token realm gets the Basic credentials).
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import json
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from envbuild.errors import StoreError, StoreUnavailable
from envbuild.store._http_guard import (
    WATCHDOG,
    AddressRefused,
    BodyTooLarge,
    guarded_connect,
    read_body,
    resolve,
)
from envbuild.store._registry_auth import auth_files, find_credentials, parse_challenge
from envbuild.store._registry_format import MAX_MANIFEST_SIZE, RegistryURL, plain_http

#: The most any answer that is read whole may hold (manifests, tag pages, errors, tokens).
MAX_RESPONSE = MAX_MANIFEST_SIZE
#: A blob download's deadline grows by one second for this many bytes.
MIN_RATE = 256 << 10
#: The blob hosts public registries redirect blob reads to (their documented CDN hosts),
#: allowed for that registry without configuration; any other is ``blob_hosts``' business.
KNOWN_BLOB_HOSTS = {
    "registry-1.docker.io": frozenset({"production.cloudflare.docker.com"}),
    "ghcr.io": frozenset({"pkg-containers.githubusercontent.com"}),
    **{host: frozenset({"cdn.quay.io", "cdn01.quay.io", "cdn02.quay.io", "cdn03.quay.io"})
       for host in ("quay.io", "registry.redhat.io", "registry.access.redhat.com")},
}
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclasses.dataclass
class _Response:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    url: str
    reason: str = ""

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default) or default

    def error_code(self) -> str:
        try:
            errors = json.loads(self.body).get("errors") or []
            return str(errors[0].get("code", "")) if errors else ""
        except (ValueError, AttributeError, IndexError, TypeError):
            return ""

    def error_text(self) -> str:
        try:
            err = (json.loads(self.body).get("errors") or [{}])[0]
            return f"{err.get('code', '')}: {err.get('message', '')}".strip(": ")
        except (ValueError, AttributeError, IndexError, TypeError):
            return self.body[:120].decode("utf-8", "replace").strip()


_Stream = tuple[http.client.HTTPResponse, http.client.HTTPConnection]  # a body not read yet


class _Pool:
    """Keep-alive connections per ``(scheme, netloc)``, shared by threads: a request takes one
    (or opens one) and gives it back once its response was read to the end."""

    def __init__(self, timeout: float, connect_timeout: float) -> None:
        self._free: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ssl: ssl.SSLContext | None = None  # made on first HTTPS use (~20 ms)

    def take(self, scheme: str, netloc: str,
             guard: Callable[..., socket.socket] | None = None) -> http.client.HTTPConnection:
        """A connection to ``netloc``; a new one connects through ``guard`` if given (the
        address check of ``_http_guard.guarded_connect``)."""
        with self._lock:
            free = self._free.get((scheme, netloc))
            if free:
                return free.pop()
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                netloc, timeout=self.connect_timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(netloc, timeout=self.connect_timeout)
        if guard is not None:
            conn._create_connection = guard  # type: ignore[attr-defined]
        return conn

    def give(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            free = self._free.setdefault((scheme, netloc), [])
            if len(free) < 16:
                free.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for free in self._free.values() for c in free]
            self._free.clear()
        for c in conns:
            c.close()


class BlobStream(io.RawIOBase):
    """A response body read as a stream; the connection goes back to the pool once the body is
    read to the end (closed otherwise). If the connection breaks, the rest is fetched with a
    ``Range`` request (pinned to the digest), at most ``resumes`` times. The whole download,
    resumes included, ends by ``deadline`` (monotonic): the connection is shut down then."""

    def __init__(self, client: RegistryClient, url: str, resp: http.client.HTTPResponse,
                 conn: http.client.HTTPConnection, size: int, resumes: int,
                 deadline: float) -> None:
        super().__init__()
        self._client, self._url, self._resp = client, url, resp
        self._conn: http.client.HTTPConnection | None = conn  # None once released
        self._size, self._pos, self._resumes = size, 0, resumes
        self._deadline = deadline
        self._token = WATCHDOG.arm(deadline, conn)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            if self._pos >= self._size:
                self._release()
                return 0
            try:
                n = self._resp.readinto(view[:self._size - self._pos])
            except (OSError, http.client.HTTPException) as e:
                self._resume(e)
                continue
            if n == 0:
                self._resume(None)
                continue
            self._pos += n
            if self._pos >= self._size:
                self._release()
            return n

    def _release(self) -> None:
        fired = not WATCHDOG.disarm(self._token)
        if self._conn is not None:
            split = urllib.parse.urlsplit(self._url)
            if self._resp.will_close or fired:
                self._conn.close()
            else:
                self._resp.read()  # nothing left: completes the response for reuse
                self._client.pool.give(split.scheme, split.netloc, self._conn)
            self._conn = None

    def _resume(self, cause: BaseException | None) -> None:
        WATCHDOG.disarm(self._token)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if time.monotonic() >= self._deadline:
            raise self._client.too_slow("read", f"broke off at byte {self._pos} of "
                                                f"{self._size} of {self._url}")
        if self._resumes <= 0:
            why = f"{type(cause).__name__}: {cause}" if cause else "the connection closed early"
            raise StoreUnavailable(f"read {self._url}: broke off at byte {self._pos} of "
                                   f"{self._size} ({why})",
                                   hint="the registry dropped the connection repeatedly; "
                                        "retry later")
        self._resumes -= 1
        time.sleep(random.uniform(0, 0.2))
        got = self._client.open_stream(
            self._url, {"Range": f"bytes={self._pos}-"}, want=(206,), deadline=self._deadline)
        if got[1] is None:
            raise StoreError(f"read {self._url}: resuming at byte {self._pos} answered "
                             f"{got[0].status} {got[0].error_text()}".rstrip())
        self._resp, self._conn = got
        self._token = WATCHDOG.arm(self._deadline, got[1])

    def close(self) -> None:
        WATCHDOG.disarm(self._token)
        if not self.closed and self._conn is not None:
            self._conn.close()  # not read to the end: the connection cannot be reused
            self._conn = None
        super().close()


@dataclasses.dataclass
class _Tries:
    """What one request has used up: tries, 401 answers, redirects; and when it must end."""

    attempts: int
    deadline: float
    attempt: int = 0
    auth: int = 0
    redirects: int = 0


class RegistryClient:
    """Requests to one registry for one repository (``address``): the connection pool, the
    ``Authorization`` that works, retries, redirects and deadlines. ``RegistryStore`` holds one;
    its constructor's docstring describes the parameters."""

    def __init__(self, address: RegistryURL, *, insecure: Iterable[str] = (),
                 credentials: tuple[str, str] | None = None,
                 auth_paths: Iterable[Path] | None = None,
                 environ: Mapping[str, str] | None = None, attempts: int = 4,
                 timeout: float = 30.0, connect_timeout: float = 5.0, backoff: float = 0.1,
                 deadline: float = 300.0, blob_hosts: Iterable[str] | None = None) -> None:
        self.address = address
        self.insecure = tuple(insecure)
        self.scheme = "http" if plain_http(address.hostname, self.insecure) else "https"
        self.attempts = max(1, attempts)
        self.backoff = backoff
        environ = os.environ if environ is None else environ
        self.deadline = deadline
        if blob_hosts is None:
            blob_hosts = environ.get("ENVBUILD_REGISTRY_BLOB_HOSTS", "").split(",")
        self.blob_hosts = (frozenset(h.strip().lower() for h in blob_hosts if h.strip())
                           | KNOWN_BLOB_HOSTS.get(address.hostname, frozenset()))
        self._guard: Callable[..., socket.socket] | None = None
        files = list(auth_paths) if auth_paths is not None else auth_files(environ)
        self.credentials = (credentials if credentials is not None
                            else find_credentials(address, files))
        self.pool = _Pool(timeout, connect_timeout)
        self._auth: str | None = None  # the Authorization header value that works
        self._auth_lock = threading.Lock()

    @property
    def url(self) -> str:
        return str(self.address)

    def close(self) -> None:
        self.pool.close()

    def where(self) -> str:
        return f"registry {self.address.host}"

    def request(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                 body: bytes | None = None, attempts: int | None = None,
                 what: str = "", give_up_quietly: bool = False,
                 limit: int = MAX_RESPONSE) -> _Response:
        """One request with retries (connection errors, 429, 5xx), the auth dance on 401 and
        redirects followed for GET/HEAD (``_redirect``); the whole response body is read, at
        most ``limit`` bytes, and all of it within ``deadline``. With ``give_up_quietly`` the
        last 429/5xx answer is returned instead of raised."""
        resp, _ = self._send(method, url, headers or {}, body, attempts, what,
                             stream=False, want=(), quiet=give_up_quietly, limit=limit)
        return resp

    def open_stream(self, url: str, headers: Mapping[str, str], want: tuple[int, ...],
                    deadline: float | None = None) -> _Stream | tuple[_Response, None]:
        """``(raw response, its connection)`` for a status in ``want``, else ``(answer, None)``."""
        return self._send("GET", url, headers, None, None, "read", stream=True, want=want,
                          deadline=deadline)

    def same_registry(self, split: urllib.parse.SplitResult) -> bool:
        return (split.scheme, split.netloc.lower()) == (self.scheme, self.address.host)

    def _connect_guard(self) -> Callable[..., socket.socket]:
        """The connector for every host but the registry: public addresses, or the
        registry's own (``_http_guard.guarded_connect``)."""
        if self._guard is None:
            try:
                own = [a for _, a in resolve(self.address.hostname, 0)]
            except OSError:
                own = []
            self._guard = guarded_connect(own)
        return self._guard

    def _redirect(self, url: str, location: str, what: str) -> str:
        """Where a redirect from ``url`` may go: the registry itself or a blob host."""
        target = urllib.parse.urljoin(url, location)
        split = urllib.parse.urlsplit(target)
        host = (split.hostname or "").lower()
        if self.same_registry(split):
            return target
        if split.scheme in ("http", "https") and (split.netloc.lower() in self.blob_hosts
                                                  or host in self.blob_hosts):
            if split.scheme == "https" or plain_http(host, self.insecure):
                return target
        raise StoreError(f"{what or 'request'} {self.url}: {self.where()} redirected to "
                         f"{target[:120]}, which is neither the registry nor a blob host",
                         reference="redirect-refused",
                         hint="if the registry serves blobs from that host, allow it with "
                              "$ENVBUILD_REGISTRY_BLOB_HOSTS=HOST[:PORT] (plain HTTP also "
                              "needs --registry-insecure)")

    def too_slow(self, what: str, detail: str = "") -> StoreUnavailable:
        return StoreUnavailable(
            f"{what} {self.url}: {self.where()} did not answer within the request deadline"
            f"{f' ({detail})' if detail else ''}",
            hint=f"the registry is too slow or stalls on purpose; a request may take "
                 f"{self.deadline:.0f} s (a blob download one more second per "
                 f"{MIN_RATE >> 10} KiB)")

    def _send(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None,
              attempts: int | None, what: str, *, stream: bool, want: tuple[int, ...],
              quiet: bool = False, limit: int = MAX_RESPONSE, deadline: float | None = None):
        """Send until an answer is final: ``(response, None)``, or ``(raw, connection)`` for a
        ``stream`` whose status is in ``want``. Retries, the 401 dance and redirects happen
        here (``_exchange`` does one round trip, ``_next_url`` decides what follows it)."""
        tries = _Tries(attempts or self.attempts,
                       deadline if deadline is not None else time.monotonic() + self.deadline)
        while True:
            split = urllib.parse.urlsplit(url)
            got = self._exchange(method, split, url, headers, body, what, tries,
                                 stream=stream, want=want, limit=limit)
            if got is None:
                continue  # a connection error, retried after a pause
            if isinstance(got, tuple):
                return got
            follow = self._next_url(method, split, url, got, what, tries, quiet)
            if follow is None:
                return got, None
            url = follow

    def _headers(self, method: str, headers: Mapping[str, str], body: bytes | None,
                 same_host: bool) -> dict[str, str]:
        hdrs = {"User-Agent": "envbuild", **headers}
        if body is not None:
            hdrs.setdefault("Content-Type", "application/octet-stream")
            hdrs["Content-Length"] = str(len(body))
        elif method in ("PUT", "POST", "PATCH"):
            hdrs["Content-Length"] = "0"
        if same_host and self._auth:
            hdrs["Authorization"] = self._auth
        return hdrs

    def _exchange(self, method: str, split: urllib.parse.SplitResult, url: str,
                  headers: Mapping[str, str], body: bytes | None, what: str, tries: _Tries, *,
                  stream: bool, want: tuple[int, ...], limit: int) -> Any:
        """One round trip: the answer read whole (a ``_Response``), a ``(raw, connection)`` or
        ``(_Response, None)`` tuple that ends the request, or ``None`` after a connection error
        that is worth another try (``_retry_or_raise`` slept already)."""
        same_host = self.same_registry(split)
        hdrs = self._headers(method, headers, body, same_host)
        path = split.path + (f"?{split.query}" if split.query else "")
        conn = self.pool.take(split.scheme, split.netloc,
                              None if same_host else self._connect_guard())
        token = WATCHDOG.arm(tries.deadline, conn)
        try:
            if conn.sock is None:
                conn.connect()
            if time.monotonic() >= tries.deadline:
                raise TimeoutError("deadline")
            conn.request(method, path, body=body, headers=hdrs)
            if conn.sock is not None:
                conn.sock.settimeout(self.pool.timeout)
            raw = conn.getresponse()
            status = raw.status
            if stream and status in want:
                return raw, conn
            if status == 416:
                # distribution sends the blob's Content-Length with Go's short 416 text:
                # the body cannot be read in step with the header, so drop the connection
                conn.close()
                return _Response(status, raw.headers, b"", url), None
            # (error answers get the limit of small ones; HEAD reads b"" and completes)
            data = read_body(raw, limit if 200 <= status < 300 else MAX_RESPONSE)
        except (BodyTooLarge, AddressRefused, OSError, http.client.HTTPException) as e:
            conn.close()
            self._retry_or_raise(e, method, split, what, tries)
            return None
        finally:
            if not WATCHDOG.disarm(token):
                conn.close()  # shut down at the deadline: never back to the pool
        if raw.will_close:
            conn.close()
        else:
            self.pool.give(split.scheme, split.netloc, conn)
        return _Response(status, raw.headers, data, url, raw.reason)

    def _retry_or_raise(self, e: BaseException, method: str, split: urllib.parse.SplitResult,
                        what: str, tries: _Tries) -> None:
        """After a failed round trip: raise the error it means, or sleep before the next try."""
        verb = what or method.lower()
        if isinstance(e, BodyTooLarge):
            size = f"{e.declared} bytes" if e.declared is not None else "more"
            raise StoreError(f"{verb} {self.url}: {self.where()} sent {size} for an answer of "
                             f"at most {e.limit} bytes", reference="response-too-large",
                             hint="the registry is misbehaving or hostile; nothing of the "
                                  "answer was kept") from None
        if isinstance(e, AddressRefused):
            raise StoreError(f"{verb} {self.url}: refusing to connect to {split.netloc}: {e}",
                             reference="redirect-refused",
                             hint="a registry may send clients to public addresses only, "
                                  "or to its own") from None
        if time.monotonic() >= tries.deadline:
            raise self.too_slow(verb) from None
        tries.attempt += 1
        if tries.attempt >= tries.attempts:
            raise self._unreachable(e, what, tries.attempts, split.netloc) from None
        self.sleep(tries.attempt, deadline=tries.deadline)

    def _next_url(self, method: str, split: urllib.parse.SplitResult, url: str,
                  resp: _Response, what: str, tries: _Tries, quiet: bool) -> str | None:
        """Where to send the request next (the same URL after a retryable status or a new
        Authorization, a redirect's target), ``None`` if ``resp`` is the answer; raises for
        answers that are errors whatever the caller asked (too many 5xx, 401, 403)."""
        status, verb = resp.status, what or method.lower()
        if status in RETRY_STATUS:
            tries.attempt += 1
            if tries.attempt < tries.attempts and time.monotonic() < tries.deadline:
                self.sleep(tries.attempt, resp.header("Retry-After"), deadline=tries.deadline)
                return url
            if quiet:
                return None
            raise StoreUnavailable(
                f"{verb} {self.url}: {self.where()} answered {status} "
                f"{resp.error_text() or resp.reason} ({tries.attempt} attempts)",
                hint="the registry is overloaded or failing; retry later")
        if status == 401 and self.same_registry(split) and tries.auth < 2:
            tries.auth += 1
            if self._authenticate(resp.header("WWW-Authenticate"), what):
                return url
        if status in (301, 302, 303, 307, 308) and method in ("GET", "HEAD") \
                and tries.redirects < 5 and resp.header("Location"):
            tries.redirects += 1
            return self._redirect(url, resp.header("Location"), what)
        if status == 401:
            raise self._denied(resp, what)
        if status == 403:
            right = "push" if method in ("PUT", "POST", "PATCH", "DELETE") else "pull"
            raise StoreUnavailable(
                f"{verb} {self.url}: {self.where()} denied access "
                f"(403 {resp.error_text()})".rstrip(),
                hint=f"the account has no {right} permission on {self.address.repo}; "
                     "check it with the registry's administrator")
        return None

    def sleep(self, attempt: int, retry_after: str = "", *,
               deadline: float = float("inf")) -> None:
        delay = min(2.0, self.backoff * (2 ** (attempt - 1)))
        if retry_after.isdigit():
            delay = min(5.0, float(retry_after))
        delay = min(random.uniform(delay / 2, delay), deadline - time.monotonic())
        if delay > 0:
            time.sleep(delay)

    def _unreachable(self, e: BaseException, what: str, attempts: int,
                     netloc: str) -> StoreUnavailable:
        cause = (e.strerror if isinstance(e, OSError) and e.strerror
                 else str(e) or type(e).__name__)
        # a garbled answer (http.client.BadStatusLine) carries what the server sent: one line
        cause = " ".join(cause.split())[:160]
        if isinstance(e, ssl.SSLError):
            return StoreUnavailable(
                f"{what or 'request'} {self.url}: TLS with {netloc} failed: {cause}",
                hint=f"if {self.address.hostname} serves plain HTTP, pass "
                     f"--registry-insecure {self.address.hostname}")
        if isinstance(e, socket.gaierror):
            return StoreUnavailable(f"{what or 'request'} {self.url}: unknown host {netloc} "
                                    f"({cause})", hint="check the host in the store URL")
        return StoreUnavailable(
            f"{what or 'request'} {self.url}: cannot reach {netloc}: {cause} "
            f"({attempts} attempt{'s' if attempts > 1 else ''})",
            hint="check the store URL and that the registry is up")

    def _denied(self, resp: _Response, what: str) -> StoreUnavailable:
        files = " or ".join(str(p) for p in auth_files(os.environ)) or "~/.docker/config.json"
        if self.credentials is None:
            return StoreUnavailable(
                f"{what or 'request'} {self.url}: {self.where()} requires credentials (401)",
                hint=f"log in (podman login {self.address.host}, or docker login); envbuild "
                     f"reads {files}")
        return StoreUnavailable(
            f"{what or 'request'} {self.url}: {self.where()} refused the credentials of "
            f"{self.credentials[0]!r} (401 {resp.error_text()})".rstrip(),
            hint=f"check the user and password for {self.address.host} in {files}")

    def _authenticate(self, challenge: str, what: str) -> bool:
        """Answer a 401 challenge; True if there is a new Authorization header to try."""
        scheme, params = parse_challenge(challenge)
        basic = None
        if self.credentials is not None:
            basic = "Basic " + base64.b64encode(
                f"{self.credentials[0]}:{self.credentials[1]}".encode()).decode()
        with self._auth_lock:
            if scheme == "basic":
                if basic is None or self._auth == basic:
                    return False
                self._auth = basic
                return True
            if scheme != "bearer" or not params.get("realm"):
                return False
            token = self._fetch_token(params, basic, what)
            new = f"Bearer {token}"
            if new == self._auth:
                return False
            self._auth = new
            return True

    def _fetch_token(self, params: Mapping[str, str], basic: str | None, what: str) -> str:
        query = {k: params[k] for k in ("service", "scope") if params.get(k)}
        if "scope" not in query:
            query["scope"] = f"repository:{self.address.repo}:pull"
        if self.credentials is not None:
            query["account"] = self.credentials[0]
        realm = params["realm"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        split = urllib.parse.urlsplit(url)
        if split.scheme not in ("http", "https"):
            raise StoreError(f"{what or 'request'} {self.url}: the registry's auth realm "
                             f"{realm[:120]!r} is not an http(s) URL")
        conn = self.pool.take(split.scheme, split.netloc,
                               None if self.same_registry(split) else self._connect_guard())
        headers = {"User-Agent": "envbuild"}
        if basic:
            headers["Authorization"] = basic
        token = WATCHDOG.arm(time.monotonic() + self.deadline, conn)
        try:
            conn.request("GET", split.path + "?" + split.query, headers=headers)
            raw = conn.getresponse()
            data = read_body(raw, MAX_RESPONSE)
        except BodyTooLarge:
            raise StoreError(f"{what or 'request'} {self.url}: the token server "
                             f"{split.netloc} sent an answer over {MAX_RESPONSE} bytes",
                             reference="response-too-large") from None
        except (OSError, http.client.HTTPException) as e:
            raise StoreUnavailable(f"{what or 'request'} {self.url}: cannot reach the token "
                                   f"server {split.netloc}: {e}",
                                   hint="the registry sent clients to this auth realm; "
                                        "check that it is up") from None
        finally:
            WATCHDOG.disarm(token)
            conn.close()
        if raw.status in (401, 403):
            files = " or ".join(str(p) for p in auth_files(os.environ)) or "an auth file"
            who = (f"the credentials of {self.credentials[0]!r}" if self.credentials
                   else "anonymous access")
            raise StoreUnavailable(f"{what or 'request'} {self.url}: the token server "
                                   f"{split.netloc} refused {who} ({raw.status})",
                                   hint=f"log in (podman login {self.address.host}); envbuild "
                                        f"reads {files}")
        try:
            doc = json.loads(data)
            token = doc.get("token") or doc.get("access_token")
            if not isinstance(token, str) or not token:
                raise ValueError("no token in the answer")
        except (ValueError, AttributeError) as e:
            raise StoreUnavailable(f"{what or 'request'} {self.url}: bad answer from the "
                                   f"token server {split.netloc} ({raw.status}: {e})") from None
        return token

    def status_error(self, resp: _Response, what: str) -> StoreError:
        return StoreError(f"{what} {self.url}: {self.where()} answered {resp.status} "
                          f"{resp.error_text()}".rstrip())
