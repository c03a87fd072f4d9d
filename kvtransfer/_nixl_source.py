"""The source side of the ``nixl`` protocol (private to ``kvtransfer.nixl``).

A source grants each read of published blocks before the reader's one-sided READ moves them, and
counts it as in progress until the reader's ``read_end``, so an unpublished request's blocks are
not reported free (``take_unpublished``) under a READ. A ``read_begin`` or ``release`` must
present the publication's grant (``KVRef.grant``), else it is refused or ignored. Everything
here runs on the backend's I/O thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvtransfer._common import PublishedBlocks
from splitserve.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)


def notif_bytes(**body: Any) -> bytes:
    """A serialized ``NixlNotif`` with ``body``'s fields."""
    return pb.NixlNotif(**body).SerializeToString()


def send_notif(agent: Any, agent_name: str, message: bytes) -> bool:
    """Send a notification to ``agent_name``; False (logged) when NIXL cannot."""
    try:
        agent.send_notif(agent_name, message)
    except Exception as exc:  # nixl raises its own exception types
        logger.warning("nixl notification to %s failed: %s", agent_name, exc)
        return False
    return True


def remove_agent(agent: Any, agent_name: str) -> None:
    """Forget a remote agent (and disconnect from it); errors are only logged."""
    try:
        agent.remove_remote_agent(agent_name)
    except Exception as exc:
        logger.debug("removing nixl agent %s: %s", agent_name, exc)


@dataclass(slots=True)
class _Grant:
    """A granted read not yet ended."""

    req_id: str
    expires_s: float


class NixlSource:
    """Answers readers: grants or refuses ``read_begin``, ends reads, applies ``release``.

    A reader that dies mid-read never sends ``read_end``; its grant expires after twice the io
    timeout (the reader's own deadline cancelled the READ long before).
    """

    def __init__(self, agent: Any, published: PublishedBlocks, io_timeout_s: float) -> None:
        self._agent = agent
        self._published = published
        self._io_timeout_s = io_timeout_s
        self._grants: dict[tuple[str, int], _Grant] = {}  # (reader agent, seq) -> grant
        self._readers: set[str] = set()  # reader agents whose connection info is loaded

    def on_notif(self, agent_name: str, notif: pb.NixlNotif) -> None:
        """Answer a reader's ``read_begin``, end a read at ``read_end``, apply a ``release``
        that presents its request's grant; anything else is logged and ignored."""
        kind = notif.WhichOneof("body")
        if kind == "read_begin":
            self._on_read_begin(agent_name, notif.read_begin, notif.reader_metadata)
        elif kind == "read_end":
            grant = self._grants.pop((agent_name, notif.read_end.seq), None)
            if grant is not None:
                self._published.end_read(grant.req_id)
        elif kind == "release":
            self._published.release(notif.release.req_id, notif.release.grant)
        else:
            logger.warning("unexpected nixl notification %s from %s", kind, agent_name)

    def expire_grants(self) -> None:
        """End the granted reads whose reader never sent ``read_end`` in time."""
        now_s = time.monotonic()
        for key, grant in list(self._grants.items()):
            if now_s > grant.expires_s:
                del self._grants[key]
                self._published.end_read(grant.req_id)

    def _on_read_begin(
        self, agent_name: str, begin: pb.KVReadRequest, reader_metadata: bytes
    ) -> None:
        if agent_name not in self._readers:
            try:
                self._agent.add_remote_agent(reader_metadata)
            except Exception as exc:
                logger.warning("cannot answer kv reader %s: %s", agent_name, exc)
                return
            self._readers.add(agent_name)
        error = self._published.begin_read(begin.req_id, begin.grant, list(begin.block_ids))
        if error is None:
            expires_s = time.monotonic() + 2 * self._io_timeout_s
            self._grants[(agent_name, begin.seq)] = _Grant(begin.req_id, expires_s)
        else:
            logger.info("refused kv read req_id=%s: %s", begin.req_id, error)
        grant = pb.KVReadResponse(seq=begin.seq, ok=error is None, error=error or "")
        if send_notif(self._agent, agent_name, notif_bytes(read_grant=grant)):
            return
        # The reader went away: end what we granted and forget its connection.
        if error is None:
            self._published.end_read(self._grants.pop((agent_name, begin.seq)).req_id)
        self._readers.discard(agent_name)
        remove_agent(self._agent, agent_name)
