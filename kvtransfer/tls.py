"""Mutual TLS on the connections of the ``tcp`` and ``ucx`` KV transfer backends.

Both ends present a certificate the cluster CA signed and check that the other's names one of
``peer_names`` (its subject's common name: a decode worker admits ``prefill`` sources, a prefill
worker ``decode`` readers) before a single frame, hence before any grant, crosses the wire:

- ``tcp`` wraps each connection in TLS 1.3 (``stream_context``): frames and block bytes are
  encrypted and authenticated;
- ``ucx`` runs the TLS 1.3 handshake over UCX messages (``MessageTls``) and seals every frame of
  the pull protocol (hello, read, response, release) with it; block bytes move raw, straight
  between the two caches, like the one-sided reads of ``nixl``. Grants therefore never travel in
  the clear, and only a peer holding a cluster certificate may ask for blocks.

The material is read from files (the ``ssl`` module loads a certificate chain only from a
path): the directory a worker's ``--tls-dir`` names.
"""

from __future__ import annotations

import ssl
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtransfer.base import KVTransferError

_CERT_FILE = "tls.crt"
_KEY_FILE = "tls.key"
_CA_FILE = "ca.crt"
# Plaintext read from a TLS object per call; a frame spans as many calls as it needs.
_READ_CHUNK_BYTES = 1 << 20


class TlsFailure(KVTransferError):
    """A handshake failed or a peer's certificate names no admitted identity. ``alert`` holds
    the TLS alert to send the peer, if any (so that it fails at once, not on a timeout)."""

    def __init__(self, message: str, alert: bytes = b"") -> None:
        super().__init__(message)
        self.alert = alert


@dataclass(frozen=True, slots=True)
class KVTransferTls:
    """One worker's certificate, key and cluster CA (paths), and the identities it pairs with.

    Invariant: ``peer_names`` is not empty (a KV endpoint that admits nobody is a mistake).
    """

    cert_file: str
    key_file: str
    ca_file: str
    peer_names: frozenset[str]

    def __post_init__(self) -> None:
        if not self.peer_names:
            raise ValueError("KVTransferTls needs at least one peer name")

    @classmethod
    def from_dir(cls, tls_dir: str | Path, peer_names: Collection[str]) -> KVTransferTls:
        """The material of a ``--tls-dir`` (``tls.crt``, ``tls.key``, ``ca.crt``);
        ``ValueError`` naming a missing file."""
        root = Path(tls_dir)
        cert, key, ca = (root / name for name in (_CERT_FILE, _KEY_FILE, _CA_FILE))
        for path in (cert, key, ca):
            if not path.is_file():
                raise ValueError(f"KV transfer TLS: no file {path}")
        return cls(str(cert), str(key), str(ca), frozenset(peer_names))

    def stream_context(self, server_side: bool) -> ssl.SSLContext:
        """A TLS 1.3 context that presents our certificate and demands one the CA signed (host
        names are not checked: peers are dialed by pod address, ``check_peer`` checks who they
        are). Servers send no session tickets: every connection does a full handshake."""
        protocol = ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(self.cert_file, self.key_file)
        context.load_verify_locations(cafile=self.ca_file)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        if server_side:
            context.num_tickets = 0
        return context

    def check_peer(self, certificate: dict[str, Any] | None) -> str:
        """The common name of a verified peer ``certificate`` (``getpeercert()``);
        ``TlsFailure`` unless it is one of ``peer_names``."""
        names = [
            value
            for rdn in (certificate or {}).get("subject", ())
            for key, value in rdn
            if key == "commonName"
        ]
        name = names[0] if names else None
        if name not in self.peer_names:
            raise TlsFailure(
                f"KV peer certificate names {name!r}, not one of {sorted(self.peer_names)}"
            )
        return name


class MessageTls:
    """TLS over a transport that moves whole messages (``ucx``), through memory buffers.

    ``handshake`` yields what to send and takes what arrives until both sides are done; then
    ``seal`` turns one plaintext frame into one message and ``open`` turns one received message
    back into its frame. Messages must be delivered in order (UCX keeps the order of one
    endpoint's tagged messages). Not thread-safe: one connection, one task.
    """

    def __init__(self, tls: KVTransferTls, server_side: bool) -> None:
        self._tls = tls
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._object = tls.stream_context(server_side).wrap_bio(
            self._incoming, self._outgoing, server_side=server_side
        )
        self.peer_name = ""

    def handshake_step(self, received: bytes | None) -> tuple[bytes, bool]:
        """Feed ``received`` (None to start) and advance the handshake; return the bytes to send
        (possibly empty) and whether the handshake is complete, in which case the peer's
        certificate was checked and ``peer_name`` is set. ``TlsFailure`` (with the alert to
        send) when the handshake or the peer check fails."""
        if received:
            self._incoming.write(received)
        try:
            self._object.do_handshake()
        except ssl.SSLWantReadError:
            return self._outgoing.read(), False
        except ssl.SSLError as exc:
            raise TlsFailure(f"TLS handshake failed: {exc}", self._outgoing.read()) from None
        self.peer_name = self._tls.check_peer(self._object.getpeercert())
        return self._outgoing.read(), True

    def seal(self, plaintext: bytes) -> bytes:
        """The message that carries ``plaintext`` (after the handshake)."""
        self._object.write(plaintext)
        return self._outgoing.read()

    def open(self, message: bytes) -> bytes:
        """The plaintext ``message`` carries (empty when it holds no whole record); ``TlsFailure``
        when it was not sealed by this connection's peer (forged, altered or replayed)."""
        self._incoming.write(message)
        chunks: list[bytes] = []
        try:
            while True:
                chunks.append(self._object.read(_READ_CHUNK_BYTES))
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError as exc:
            raise TlsFailure(f"bad sealed message: {exc}") from None
        return b"".join(chunks)
