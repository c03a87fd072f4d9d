"""API key files and the key store: parsing, roles, rotation by reload, refusal."""

from __future__ import annotations

import hashlib

import pytest

from services.common.api_keys import ApiKeyStore, KeyRole, make_key, parse_key_file

ADMIN = "admin-key-0123456789abcdef"
DATA = "data-key-0123456789abcdef"
NEW = "new-data-key-0123456789abcdef"


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_parse_roles_comments_and_default_role():
    keys = parse_key_file(
        f"# the cluster's keys\n\n{ADMIN} admin\n{DATA}   data  # ci\n{NEW}\n", "keys"
    )
    assert [k.role for k in keys] == [KeyRole.ADMIN, KeyRole.DATA, KeyRole.DATA]
    assert keys[0].digest == hashlib.sha256(ADMIN.encode()).digest()
    assert keys[0].fingerprint == hashlib.sha256(ADMIN.encode()).hexdigest()[:8]
    assert {k.tenant for k in keys} == {"default"}


def test_a_key_may_name_its_tenant_with_or_without_a_role():
    keys = parse_key_file(f"{ADMIN} admin tenant=ops\n{DATA} tenant=acme.eu-1\n", "keys")
    assert [(k.role, k.tenant) for k in keys] == [
        (KeyRole.ADMIN, "ops"),
        (KeyRole.DATA, "acme.eu-1"),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (f"{ADMIN} root\n", r"keys:1: role must be data or admin, got 'root'"),
        (f"\n{ADMIN} admin extra\n", r"keys:2: expected 'KEY \[data\|admin\] \[tenant=NAME\]'"),
        (f"{ADMIN} data tenant=-x\n", r"keys:1: tenant name '-x': 1 to 64 of letters"),
        (f"{ADMIN} data tenant=\n", r"keys:1: tenant name '': 1 to 64"),
        ("short admin\n", r"keys:1: an API key must have at least 16 characters"),
    ],
)
def test_parse_errors_name_the_file_and_line(text, error):
    with pytest.raises(ValueError, match=error):
        parse_key_file(text, "keys")


def test_roles_allow():
    assert KeyRole.ADMIN.allows(KeyRole.ADMIN) and KeyRole.ADMIN.allows(KeyRole.DATA)
    assert KeyRole.DATA.allows(KeyRole.DATA) and not KeyRole.DATA.allows(KeyRole.ADMIN)


def test_authenticate(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"{ADMIN} admin\n{DATA}\n")
    store = ApiKeyStore(str(key_file))
    assert store.enabled
    admin = store.authenticate(bearer(ADMIN))
    assert admin is not None and admin.role is KeyRole.ADMIN
    data = store.authenticate(bearer(DATA))
    assert data is not None and data.role is KeyRole.DATA
    for refused in (None, "", DATA, f"Basic {DATA}", bearer(DATA[:-1]), bearer(NEW)):
        assert store.authenticate(refused) is None


def test_reload_rotates_and_keeps_the_old_keys_on_a_bad_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"{ADMIN} admin\n{DATA}\n")
    store = ApiKeyStore(str(key_file), inline_key=NEW)
    assert store.authenticate(bearer(NEW)).role is KeyRole.ADMIN  # the inline key is admin
    key_file.write_text(f"{ADMIN} admin\n{DATA} nobody\n")
    store.reload()
    assert store.authenticate(bearer(DATA)) is not None
    key_file.write_text(f"{ADMIN} admin\n")
    store.reload()
    assert store.authenticate(bearer(DATA)) is None
    assert store.authenticate(bearer(ADMIN)) is not None
    assert store.authenticate(bearer(NEW)) is not None  # the inline key survives reloads


def test_no_keys_configured_means_disabled_and_a_missing_file_is_an_error(tmp_path):
    assert not ApiKeyStore().enabled
    with pytest.raises(ValueError, match="cannot read API key file"):
        ApiKeyStore(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="whitespace"):
        make_key("0123456789abcdef 0123", KeyRole.DATA)


def test_reload_if_changed_follows_a_replaced_file(tmp_path):
    """As a Kubernetes Secret update does: a new file swapped in under the same path."""
    key_file = tmp_path / "keys"
    key_file.write_text(f"{DATA}\n")
    store = ApiKeyStore(str(key_file))
    store.reload_if_changed()  # unchanged: nothing to do
    assert store.authenticate(bearer(DATA)) is not None
    replacement = tmp_path / "keys.new"
    replacement.write_text(f"{NEW} data\n")
    replacement.replace(key_file)
    store.reload_if_changed()
    assert store.authenticate(bearer(NEW)) is not None
    assert store.authenticate(bearer(DATA)) is None
    key_file.unlink()
    store.reload_if_changed()  # gone: the keys in force stay
    assert store.authenticate(bearer(NEW)) is not None
