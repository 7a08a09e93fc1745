"""TLS for outbound calls that carry a bearer token and training data (remote environments, remote reward
plugins, LLM judges: reward_service/httpcall.py).

A request to such a server holds its token and the prompts and reference answers: whoever answers on the
server's address gets them. So (``HttpOptions``, docs/security.md "Remote environments and plugins"):

- ``https://`` URLs are verified against the system's CAs, or only against ``ca_file`` (a private CA, or the
  server's own self-signed certificate) when it is given; the host name must match the certificate.
- ``pin_sha256`` (the SHA-256 of the server certificate's DER bytes, 64 hex digits) refuses any other
  certificate, whoever signed it. It is checked when the TLS handshake completes, before a byte of the
  request is sent (:func:`tls_context` makes the context's connections check it as they handshake).
- ``http://`` is accepted only to a loopback host, unless ``allow_plain_http`` says otherwise.

A server that fails verification is a ``tls_unverified`` failure, not retried (retrying cannot help).
"""

from __future__ import annotations

import hashlib
import ssl
from urllib.parse import urlsplit

from broker.runtime.binds import is_loopback


class PinMismatch(ssl.SSLCertVerificationError):
    """The server's certificate is not the pinned one."""


class _PinnedSSLObject(ssl.SSLObject):
    """An SSLObject (what asyncio/anyio connections use) that refuses a peer certificate other than ``pin``
    once its handshake completes: the caller sees the handshake fail, so no request is written."""

    pin = b""

    def do_handshake(self) -> None:
        super().do_handshake()  # raises SSLWantRead/WriteError until the handshake is done
        _check_pin(self.getpeercert(binary_form=True), self.pin)


class _PinnedSSLSocket(ssl.SSLSocket):
    """The same for blocking sockets (a synchronous client)."""

    pin = b""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_pin(self.getpeercert(binary_form=True), self.pin)


def _check_pin(der: bytes | None, pin: bytes) -> None:
    got = hashlib.sha256(der).hexdigest() if der else "none"
    if got != pin.hex():
        raise PinMismatch(f"the server's certificate (sha256 {got}) is not the pinned one (pin_sha256 {pin.hex()})")


def certificate_sha256(der: bytes) -> str:
    """The value of ``pin_sha256`` for a certificate given as DER bytes."""
    return hashlib.sha256(der).hexdigest()


def tls_context(ca_file: str = "", pin_sha256: str = "") -> ssl.SSLContext:
    """A verifying client context: the system's CAs, or only ``ca_file``'s; with ``pin_sha256``, only that
    certificate is accepted (on top of the verification, never instead of it)."""
    ctx = ssl.create_default_context(cafile=ca_file or None)
    if pin_sha256:
        pin = bytes.fromhex(pin_sha256)
        ctx.sslobject_class = type("PinnedSSLObject", (_PinnedSSLObject,), {"pin": pin})
        ctx.sslsocket_class = type("PinnedSSLSocket", (_PinnedSSLSocket,), {"pin": pin})
    return ctx


def check_transport(url: str, ca_file: str, pin_sha256: str, allow_plain_http: bool) -> None:
    """ValueError (naming the option) when ``url`` would send the token unverified, or the TLS options do not
    apply to it."""
    parts = urlsplit(url)
    if parts.scheme == "http":
        if ca_file or pin_sha256:
            raise ValueError(f"ca_file and pin_sha256 need an https:// url, not {url!r}")
        if not allow_plain_http and not is_loopback(parts.hostname or ""):
            raise ValueError(
                f"url {url!r} is plain http to a host other than loopback: its bearer token, prompts "
                "and reference answers would go to whoever holds that address. Use https:// (with "
                "ca_file and/or pin_sha256 for a private server), or set allow_plain_http = true on "
                "a network you trust"
            )
    if ca_file:
        try:
            ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"ca_file {ca_file!r} cannot be read as PEM certificates: {e}") from None


def is_tls_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (an httpx error) came from a certificate that failed verification or its pin."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
