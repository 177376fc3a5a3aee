"""A real loopback HTTP server for media URL tests (threaded ``http.server`` on 127.0.0.1, a free port), with
one route per behaviour a fetch must survive:

- ``/img/<seed>.png``: a seeded random PNG (``image/png``); ``/video.mp4``: the video set in ``videos``;
- ``/slow.png``: waits ``SLOW_S`` seconds before answering; ``/trickle.png``: sends its body a byte per 0.2 s;
- ``/big.png``: declares and sends ``BIG`` bytes; ``/chunked-big.png``: ``BIG`` bytes without a length;
- ``/page.html``: ``text/html``; ``/missing.png``: 404; ``/fail.png``: 500;
- ``/redirect?to=URL``: 302 to URL; ``/loop``: 302 to itself.
"""

from __future__ import annotations

import functools
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from tests.server.image_files import image_bytes, random_image

SLOW_S = 4.0
BIG = 200_000


@dataclass
class MediaServer:
    base: str
    port: int
    hits: dict[str, int] = field(default_factory=dict)
    videos: dict[str, bytes] = field(default_factory=dict)


@functools.lru_cache(maxsize=64)
def png(seed: int) -> bytes:
    """The PNG of ``random_image(seed, (84, 56))`` (encoded once: the server stays fast under load)."""
    return image_bytes(random_image(seed, (84, 56)))


def _handler(state: MediaServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, ctype: str, body: bytes, length: bool = True) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            if length:
                self.send_header("Content-Length", str(len(body)))
            else:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if length:
                self.wfile.write(body)
            else:
                for i in range(0, len(body), 8192):
                    piece = body[i:i + 8192]
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

        def _redirect(self, to: str) -> None:
            self.send_response(302)
            self.send_header("Location", to)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            parts = urlsplit(self.path)
            path = parts.path
            state.hits[path] = state.hits.get(path, 0) + 1
            try:
                if path.startswith("/img/") and path.endswith(".png"):
                    self._send(200, "image/png", png(int(path[5:-4])))
                elif path in state.videos:
                    self._send(200, "video/mp4", state.videos[path])
                elif path == "/slow.png":
                    time.sleep(SLOW_S)
                    self._send(200, "image/png", image_bytes(random_image(1, (84, 56))))
                elif path == "/trickle.png":
                    body = image_bytes(random_image(1, (84, 56)))
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for b in body[:40]:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.2)
                elif path == "/big.png":
                    self._send(200, "image/png", b"\x89PNG" + b"\0" * BIG)
                elif path == "/chunked-big.png":
                    self._send(200, "image/png", b"\x89PNG" + b"\0" * BIG, length=False)
                elif path == "/page.html":
                    self._send(200, "text/html; charset=utf-8", b"<html>not an image</html>")
                elif path == "/fail.png":
                    self._send(500, "text/plain", b"boom")
                elif path == "/redirect":
                    self._redirect(parse_qs(parts.query)["to"][0])
                elif path == "/loop":
                    self._redirect("/loop")
                else:
                    self._send(404, "text/plain", b"no such file")
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


def self_signed(dir_: Path, name: str) -> tuple[Path, Path]:
    """A CA-less self-signed certificate for DNS name ``name`` (and its key), as PEM files in ``dir_``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = dir_ / f"{name}.crt", dir_ / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@contextmanager
def media_server(tls: tuple[Path, Path] | None = None) -> Iterator[MediaServer]:
    """The server, serving until the block ends; ``tls`` (certificate, key): over HTTPS."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(MediaServer("", 0)))
    httpd.daemon_threads = True
    port = httpd.server_address[1]
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*tls)
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    state = MediaServer(f"{'https' if tls else 'http'}://127.0.0.1:{port}", port)
    httpd.RequestHandlerClass = _handler(state)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
