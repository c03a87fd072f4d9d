"""Build a KV transfer backend by its name (one of ``BACKENDS``)."""

from __future__ import annotations

from kvtransfer.base import KVTransferBackend
from kvtransfer.inproc import InprocBackend
from kvtransfer.tcp import TcpBackend

BACKENDS = ("tcp", "inproc")


def make_backend(
    name: str,
    engine_id: str,
    *,
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
) -> KVTransferBackend:
    """A new, unregistered backend ``name`` for ``engine_id``; ``ValueError`` naming the
    choices when ``name`` is unknown. ``host`` / ``advertise_host`` only matter for ``tcp``
    (which listens on an ephemeral port of ``host``)."""
    if name == "tcp":
        return TcpBackend(engine_id, host=host, advertise_host=advertise_host)
    if name == "inproc":
        return InprocBackend(engine_id)
    raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {BACKENDS}")
