"""Tenant limits: the ``--tenant-limits`` spec, the concurrency cap and the token bucket (on a
clock the test moves), and the cache salt that keeps tenants' blocks apart."""

from __future__ import annotations

import pytest

from services.router.tenants import (
    RefusalReason,
    TenantGate,
    TenantLimits,
    parse_tenant_limits,
    tenant_cache_salt,
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_spec_parses_names_limits_and_the_default_entry():
    limits = parse_tenant_limits(
        " acme: max_concurrent_requests=8 , max_tokens_per_s=2000 ;*:max_tokens_per_s=0.5;"
    )
    assert limits == {
        "acme": TenantLimits(max_concurrent_requests=8, max_tokens_per_s=2000.0),
        "*": TenantLimits(max_tokens_per_s=0.5),
    }
    assert parse_tenant_limits("") == {}
    gate = TenantGate(parse_tenant_limits("gold:priority=-1;*:priority=7"))
    assert (gate.priority("gold"), gate.priority("anyone")) == (-1, 7)
    assert TenantGate({}).priority("anyone") == 0


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("acme", "expected NAME:LIMIT=VALUE"),
        ("acme:max_rps=1", "acme: unknown limit 'max_rps'"),
        ("acme:max_tokens_per_s=fast", "acme: max_tokens_per_s must be a number"),
        ("acme:max_concurrent_requests=0", "acme: max_concurrent_requests must be at least 1"),
        ("acme:max_tokens_per_s=-1", "acme: max_tokens_per_s must be positive"),
        ("a:max_tokens_per_s=1;a:max_tokens_per_s=2", "tenant 'a' is given twice"),
        ("a b:max_tokens_per_s=1", "tenant name 'a b'"),
    ],
)
def test_a_bad_spec_names_what_is_wrong(spec, error):
    with pytest.raises(ValueError, match=error):
        parse_tenant_limits(spec)


def test_the_concurrency_cap_refuses_until_a_request_ends():
    gate = TenantGate(parse_tenant_limits("acme:max_concurrent_requests=2"))
    assert gate.admit("acme") is None and gate.admit("acme") is None
    refusal = gate.admit("acme")
    assert refusal is not None and refusal.reason is RefusalReason.CONCURRENCY
    assert refusal.retry_after_s >= 1
    gate.release("acme")
    assert gate.admit("acme") is None
    # Other tenants have no limits: nothing refuses them.
    assert all(gate.admit("beta") is None for _ in range(100))


def test_the_token_bucket_admits_until_in_debt_and_says_when_it_is_repaid():
    clock = Clock()
    gate = TenantGate(parse_tenant_limits("*:max_tokens_per_s=100"), clock)
    assert gate.admit("acme") is None
    gate.charge("acme", 450)  # 100 saved up, 350 in debt
    refusal = gate.admit("acme")
    assert refusal is not None and refusal.reason is RefusalReason.TOKEN_RATE
    assert refusal.retry_after_s == 4
    assert "100 tokens per second" in refusal.message
    # Each tenant has its own bucket.
    assert gate.admit("beta") is None
    clock.now_s += 3.4
    assert gate.admit("acme") is not None
    clock.now_s += 0.2
    assert gate.admit("acme") is None
    # Idle time saves up at most one second's worth.
    clock.now_s += 3600
    gate.charge("acme", 101)
    assert gate.admit("acme") is not None


def test_tenants_never_share_a_salt_and_the_default_keeps_the_clients():
    assert tenant_cache_salt("default", "s") == "s"
    salts = {tenant_cache_salt(t, s) for t in ("acme", "beta") for s in ("", "s", "acme")}
    assert len(salts) == 6 and not salts & {"", "s", "acme"}
    assert tenant_cache_salt("acme", "s") == tenant_cache_salt("acme", "s")
