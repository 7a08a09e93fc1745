"""Certificates made in the test (``cryptography``) and a real HTTPS server speaking the remote environment's
contract (docs/agents.md) on a free port, recording every request it was sent (headers included)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Issued:
    cert_pem: Path
    key_pem: Path
    der: bytes


class CA:
    """A certificate authority of the test's own (self-signed), which issues server certificates."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name
        folder.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = folder / f"{name}-ca.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Issued:
        """A server certificate for ``hosts`` (IP addresses and DNS names), signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        sans = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        cert_pem, key_pem = self.folder / f"{name}.pem", self.folder / f"{name}.key"
        cert_pem.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM) + self.cert.public_bytes(serialization.Encoding.PEM)
        )
        key_pem.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return Issued(cert_pem, key_pem, cert.public_bytes(serialization.Encoding.DER))


@dataclass
class EnvServer:
    """An HTTPS environment server (a one-turn calc-like episode); ``requests`` holds what it was sent."""

    url: str
    httpd: ThreadingHTTPServer
    requests: list[dict] = field(default_factory=list)
    handshakes_failed: list[str] = field(default_factory=list)
    connections: int = 0  # TCP connections accepted

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def https_env_server(issued: Issued) -> EnvServer:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(issued.cert_pem, issued.key_pem)
    box: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            box["server"].requests.append(
                {"path": self.path, "authorization": self.headers.get("Authorization"), "body": body}
            )
            reply = (
                {"ok": True}
                if self.path == "/reset"
                else {"reply": None, "done": True, "reward": 1.0}
                if self.path == "/step"
                else {}
            )
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self):
            sock, addr = self.socket.accept()
            box["server"].connections += 1
            return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        def finish_request(self, request, client_address):
            try:
                request.do_handshake()
            except (ssl.SSLError, OSError) as e:  # the client refused our certificate: nothing was sent
                box["server"].handshakes_failed.append(str(e))
                return
            super().finish_request(request, client_address)

    httpd = Server(("127.0.0.1", 0), Handler)
    server = EnvServer(f"https://127.0.0.1:{httpd.server_address[1]}", httpd)
    box["server"] = server
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return server
