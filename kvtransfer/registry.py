"""Build a KV transfer backend by its name (one of ``BACKENDS``).

``nixl`` and ``ucx`` need optional packages (``pip install splitserve[nixl]`` / ``[ucx]``);
their modules are imported only when chosen, so the router and the ``tcp`` path never pay for
them. ``default_backend()`` is ``nixl`` when it can be imported, else ``tcp``.
"""

from __future__ import annotations

import importlib.util

from kvtransfer.base import KVTransferBackend
from kvtransfer.tls import KVTransferTls

BACKENDS = ("nixl", "ucx", "tcp", "inproc")
# The backends whose connections can be mutual TLS (kvtransfer.tls).
TLS_BACKENDS = ("ucx", "tcp")
# The import that each optional backend needs.
_REQUIRED_MODULES = {"nixl": "nixl", "ucx": "ucxx"}


def is_available(name: str) -> bool:
    """True when backend ``name`` exists and its optional package is installed."""
    if name not in BACKENDS:
        return False
    module = _REQUIRED_MODULES.get(name)
    return module is None or importlib.util.find_spec(module) is not None


def available_backends() -> tuple[str, ...]:
    """The backends usable in this environment, in ``BACKENDS`` order."""
    return tuple(name for name in BACKENDS if is_available(name))


def default_backend() -> str:
    """``nixl`` when importable, else ``tcp``."""
    return "nixl" if is_available("nixl") else "tcp"


def make_backend(
    name: str,
    engine_id: str,
    *,
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
    io_timeout_s: float = 10.0,
    tls: KVTransferTls | None = None,
) -> KVTransferBackend:
    """A new, unregistered backend ``name`` for ``engine_id``.

    ``ValueError`` names the choices when ``name`` is unknown, and the missing package when it
    is not installed. ``host`` / ``advertise_host`` are where socket-based backends (``tcp``,
    ``ucx``) listen and what they advertise; ``io_timeout_s`` bounds how long a read waits on
    a silent peer before it is FAILED. ``tls`` makes every connection of a ``tcp`` or ``ucx``
    backend mutual TLS; ``ValueError`` for the others (``nixl`` moves blocks by one-sided reads
    its own agents set up, ``inproc`` never leaves the process).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {BACKENDS}")
    if not is_available(name):
        raise ValueError(
            f"KV transfer backend {name!r} needs the {_REQUIRED_MODULES[name]!r} package "
            f"(pip install 'splitserve[{name}]'); available here: {available_backends()}"
        )
    if tls is not None and name not in TLS_BACKENDS:
        raise ValueError(f"KV transfer backend {name!r} has no TLS; these do: {TLS_BACKENDS}")
    if name == "nixl":
        from kvtransfer.nixl import NixlBackend

        return NixlBackend(engine_id, io_timeout_s=io_timeout_s)
    if name in ("ucx", "tcp"):
        from kvtransfer._pull_protocol import PullEndpoint

        endpoint = PullEndpoint(
            host=host, advertise_host=advertise_host, io_timeout_s=io_timeout_s, tls=tls
        )
        if name == "ucx":
            from kvtransfer.ucx import UcxBackend

            return UcxBackend(engine_id, endpoint)
        from kvtransfer.tcp import TcpBackend

        return TcpBackend(engine_id, endpoint)
    from kvtransfer.inproc import InprocBackend

    return InprocBackend(engine_id)
