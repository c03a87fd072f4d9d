"""API keys: who may call the router, and with which role.

Clients send ``authorization: Bearer KEY`` (gRPC metadata, or the HTTP header). A key has one
of two roles: ``data`` may generate; ``admin`` may also resize pools and read the cluster's
state (``Scale``, ``Status``, ``Explain``). A key may name its tenant: the tenant's requests
share its limits, priority and prefix cache (``services/router/tenants``); a key without one
is the ``default`` tenant's. Keys come from a key file and from one inline key:

    # comments and blank lines are ignored
    3b1f...e9  admin
    77ac...02  data  tenant=acme
    a4d0...5c          <- no role: data

Several keys may be valid at once (rotation: add the new key, move clients, drop the old one,
re-read the file). Keys are kept only as SHA-256 digests and compared in constant time against
every key, so neither a timing nor an early exit tells how much of a guess was right.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BEARER_PREFIX = "Bearer "
# A key shorter than this is a typo or a placeholder, not a secret.
MIN_KEY_CHARS = 16
# The tenant of keys that name none (and of every request when the router takes no keys).
DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TENANT_FIELD = "tenant="


class KeyRole(enum.Enum):
    """What a key may call: ``DATA`` generates; ``ADMIN`` may do everything."""

    DATA = "data"
    ADMIN = "admin"

    def allows(self, needed: KeyRole) -> bool:
        return self is KeyRole.ADMIN or needed is KeyRole.DATA


def check_tenant_name(name: str) -> str:
    """``name`` if it names a tenant (1 to 64 letters, digits, ``_.-``, not starting with
    one of ``_.-``); else ``ValueError``."""
    if not _TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"tenant name {name!r}: 1 to 64 of letters, digits, '_', '.', '-' (starting with a "
            "letter or digit)"
        )
    return name


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key: its digest, role, tenant and a short fingerprint safe to log."""

    digest: bytes
    role: KeyRole
    tenant: str = DEFAULT_TENANT

    @property
    def fingerprint(self) -> str:
        """The first 8 hex digits of the key's SHA-256: names the key in logs, reveals nothing."""
        return self.digest.hex()[:8]


def make_key(secret: str, role: KeyRole, tenant: str = DEFAULT_TENANT) -> ApiKey:
    """``ApiKey`` for ``secret``; ``ValueError`` if it is too short or holds whitespace, or
    ``tenant`` is not a tenant name."""
    if len(secret) < MIN_KEY_CHARS:
        raise ValueError(f"an API key must have at least {MIN_KEY_CHARS} characters")
    if any(c.isspace() for c in secret):
        raise ValueError("an API key must not contain whitespace")
    return ApiKey(hashlib.sha256(secret.encode()).digest(), role, check_tenant_name(tenant))


def parse_key_file(text: str, source: str) -> tuple[ApiKey, ...]:
    """The keys of a key file's ``text``; ``ValueError`` naming ``source`` and the line."""
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        tenant = DEFAULT_TENANT
        if len(fields) > 1 and fields[-1].startswith(_TENANT_FIELD):
            tenant = fields.pop()[len(_TENANT_FIELD) :]
        if len(fields) > 2:
            raise ValueError(f"{source}:{number}: expected 'KEY [data|admin] [tenant=NAME]'")
        try:
            role = KeyRole(fields[1]) if len(fields) == 2 else KeyRole.DATA
        except ValueError:
            raise ValueError(
                f"{source}:{number}: role must be data or admin, got {fields[1]!r}"
            ) from None
        try:
            keys.append(make_key(fields[0], role, tenant))
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: {exc}") from None
    return tuple(keys)


class ApiKeyStore:
    """The keys a server accepts: the key file's (re-read by ``reload``) plus one inline admin
    key. With neither configured, ``enabled`` is False and callers need no key. Thread-safe:
    ``reload`` swaps the whole key set at once."""

    def __init__(self, key_file: str = "", inline_key: str = "") -> None:
        self._key_file = Path(key_file) if key_file else None
        self._inline = (make_key(inline_key, KeyRole.ADMIN),) if inline_key else ()
        self._lock = threading.Lock()
        self._file_stamp: tuple[int, int, int] | None = None
        self._keys: tuple[ApiKey, ...] = self._inline + self._read_file()

    @property
    def enabled(self) -> bool:
        return self._key_file is not None or bool(self._inline)

    def _read_file(self) -> tuple[ApiKey, ...]:
        if self._key_file is None:
            return ()
        try:
            self._file_stamp = self._stamp()
            text = self._key_file.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read API key file {self._key_file}: {exc}") from None
        keys = parse_key_file(text, str(self._key_file))
        if not keys:
            logger.warning("API key file %s holds no key: every call is refused", self._key_file)
        return keys

    def _stamp(self) -> tuple[int, int, int]:
        """What changes when the key file is rewritten or replaced (a Kubernetes Secret update
        swaps the symlink it goes through): inode, size and mtime."""
        assert self._key_file is not None
        stat = self._key_file.stat()
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def reload_if_changed(self) -> None:
        """``reload`` when the key file changed since it was last read (a cheap ``stat``)."""
        if self._key_file is None:
            return
        try:
            changed = self._stamp() != self._file_stamp
        except OSError:
            changed = True  # gone or unreadable: reload says why, and keeps the keys
        if changed:
            self.reload()

    def reload(self) -> None:
        """Re-read the key file; on an error keep the current keys (and log why)."""
        try:
            keys = self._inline + self._read_file()
        except ValueError as exc:
            logger.error("API keys not reloaded, the previous ones stay valid: %s", exc)
            return
        with self._lock:
            self._keys = keys
        logger.info("API keys reloaded: %d keys", len(keys))

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key an ``authorization`` value (``Bearer KEY``) presents; None if it is missing,
        malformed or not a valid key. Takes the same time whichever key, if any, matches."""
        if not authorization or not authorization.startswith(BEARER_PREFIX):
            return None
        digest = hashlib.sha256(authorization[len(BEARER_PREFIX) :].strip().encode()).digest()
        with self._lock:
            keys = self._keys
        found = None
        for key in keys:
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found
