"""A real OCI registry on loopback for tests: Debian's ``docker-registry`` (distribution 2.8).

``Registry.start(root, auth=...)`` writes a temporary config (filesystem storage under
``root``, ``storage.delete.enabled: true``, no blob descriptor cache so a blob corrupted on
disk is served as it is) and runs ``docker-registry serve CONFIG`` on a free 127.0.0.1 port;
with ``auth="htpasswd"`` it requires HTTP basic auth from an ``htpasswd`` file made with
apache2-utils' ``htpasswd -B`` (bcrypt, what distribution accepts). ``stop()`` ends the process
and checks it is gone. ``blob_file(digest)`` is where distribution keeps a blob's bytes (for
corruption tests). ``auth="token"`` puts a ``TokenServer`` (a JWT issuer on loopback, signing
with a self-signed certificate the registry trusts) in front: distribution's Bearer flow.
``TamperingProxy`` is a loopback HTTP proxy in front of it that rewrites
answers (flips a byte of blob bodies, changes a manifest's Content-Type) — a hostile network
between envbuild and a registry.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import shutil
import socketserver
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.conftest import require_tool
from tests.store.s3server import free_port

USER, PASSWORD = "envbuild", "s3cret-pw"


class Registry:
    def __init__(self, root: Path, auth: str | None = None, *, deletes: bool = True) -> None:
        self.root = root
        self.auth = auth
        self.deletes = deletes
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.token_server: TokenServer | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, repo: str) -> str:
        return f"docker://{self.host}/{repo}"

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return (self.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256"
                / hexd[:2] / hexd / "data")

    def auth_file(self, directory: Path, password: str = PASSWORD) -> Path:
        """A podman-style auth.json with this registry's credentials."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "auth.json"
        token = base64.b64encode(f"{USER}:{password}".encode()).decode()
        path.write_text(json.dumps({"auths": {self.host: {"auth": token}}}))
        return path

    def start(self, timeout: float = 30.0) -> Registry:
        exe = require_tool("docker-registry")
        self.root.mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.auth == "htpasswd":
            htpasswd = require_tool("htpasswd")
            subprocess.run([htpasswd, "-Bbc", str(self.root / "htpasswd"), USER, PASSWORD],
                           check=True, capture_output=True)
            auth = (f"auth:\n  htpasswd:\n    realm: envbuild-test\n"
                    f"    path: {self.root / 'htpasswd'}\n")
        elif self.auth == "token":
            self.token_server = TokenServer(self.root / "token").start()
            auth = (f"auth:\n  token:\n    realm: {self.token_server.realm}\n"
                    f"    service: {TokenServer.SERVICE}\n    issuer: {TokenServer.ISSUER}\n"
                    f"    rootcertbundle: {self.token_server.cert_path}\n")
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n"
            f"  delete:\n    enabled: {'true' if self.deletes else 'false'}\n"
            "  maintenance:\n    uploadpurging:\n      enabled: false\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n" + auth)
        self.log = open(self.root / "registry.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([exe, "serve", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: "
                                   f"{(self.root / 'registry.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1):
                    return self
            except urllib.error.HTTPError:
                return self  # 401: up, and asking for credentials
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry did not answer on {self.host}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            assert self.proc.poll() is not None
            self.proc = None
            self.log.close()
        if self.token_server is not None:
            self.token_server.stop()
            self.token_server = None


@contextlib.contextmanager
def running_registry(root: Path, auth: str | None = None, *, deletes: bool = True):
    reg = Registry(root, auth, deletes=deletes).start()
    try:
        yield reg
    finally:
        reg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """A Docker token server (the ``Bearer`` realm distribution sends clients to) on loopback:
    checks HTTP basic credentials (``USER``/``PASSWORD``; none: anonymous, refused) and issues
    an RS256 JWT whose ``x5c`` is a self-signed certificate that the registry trusts
    (``rootcertbundle``), granting the requested scopes. ``requests`` counts the tokens
    issued."""

    SERVICE = "envbuild-test-registry"
    ISSUER = "envbuild-test-issuer"

    def __init__(self, root: Path) -> None:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        root.mkdir(parents=True, exist_ok=True)
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "envbuild test token issuer")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.cert_path = root / "issuer.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.port = free_port()
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                import urllib.parse

                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                want = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
                if self.headers.get("Authorization", "") != f"Basic {want}":
                    self._answer(401, {"details": "bad or no credentials"})
                    return
                scopes = " ".join(query.get("scope", [])).split()
                server.requests.append(" ".join(scopes))
                self._answer(200, {"token": server.token(scopes)})

            def _answer(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def token(self, scopes: list[str]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self.cert_der).decode()]}
        claims = {"iss": self.ISSUER, "sub": USER, "aud": self.SERVICE, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": f"{now}-{len(self.requests)}",
                  "access": access}
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{_b64url(sig)}"

    def start(self) -> TokenServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


class TamperingProxy:
    """Forwards HTTP requests to ``upstream`` (host:port) and lets ``tamper(method, path,
    status, headers, body) -> (status, headers, body)`` rewrite each answer (a header
    ``X-Test-Cut-After: N`` sends the full Content-Length but only N bytes, then hangs up);
    ``intercept(method, path)`` may answer instead of the registry (the request is then not
    forwarded). Loopback only."""

    def __init__(self, upstream: str,
                 tamper: Callable[[str, str, int, dict[str, str], bytes],
                                  tuple[int, dict[str, str], bytes]] | None = None,
                 intercept: Callable[[str, str], tuple[int, dict[str, str], bytes] | None]
                 | None = None) -> None:
        self.upstream = upstream
        self.tamper = tamper or (lambda m, p, s, h, b: (s, h, b))
        self.intercept = intercept or (lambda m, p: None)
        self.port = free_port()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                answer = proxy.intercept(self.command, self.path)
                if answer is not None:
                    status, out, data = answer
                    self.send_response(status)
                    for k, v in out.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                out = {k: v for k, v in resp.getheaders()
                       if k.lower() not in ("content-length", "connection",
                                            "transfer-encoding")}
                status, out, data = proxy.tamper(self.command, self.path, resp.status, out,
                                                 data)
                self.send_response(status)
                for k, v in out.items():
                    if k.lower() == "location":
                        v = v.replace(proxy.upstream, f"127.0.0.1:{proxy.port}")
                    self.send_header(k, v)
                cut = out.pop("X-Test-Cut-After", None)  # send this much, then hang up
                if self.command == "HEAD" and status == resp.status:
                    self.send_header("Content-Length", resp.getheader("Content-Length") or "0")
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if cut is not None:
                    self.wfile.write(data[:int(cut)])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if self.command != "HEAD":
                    try:
                        self.wfile.write(data)
                    except BrokenPipeError:
                        pass  # the client gave up on the body (e.g. after a 416)

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _any

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> TamperingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
