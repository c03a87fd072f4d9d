"""A real local cluster with its HTTP API, and clients of both APIs."""

from __future__ import annotations

import openai
import pytest

from tests.services.conftest import Client

# Errors are asserted on: no retries of 429s and 503s.
CLIENT_OPTIONS = {"api_key": "unused", "max_retries": 0, "timeout": 120.0}


@pytest.fixture(scope="module")
def http_cluster(start_cluster):
    cluster, client = start_cluster()
    return cluster, client


@pytest.fixture(scope="module")
def grpc_client(http_cluster) -> Client:
    return http_cluster[1]


@pytest.fixture(scope="module")
def base_url(http_cluster) -> str:
    return f"{http_cluster[0].http_url}/v1"


@pytest.fixture(scope="module")
def model(grpc_client) -> str:
    return grpc_client.status().model


@pytest.fixture(scope="module")
def sync_client(base_url):
    with openai.OpenAI(base_url=base_url, **CLIENT_OPTIONS) as client:
        yield client


@pytest.fixture
def async_client(base_url):
    return openai.AsyncOpenAI(base_url=base_url, **CLIENT_OPTIONS)


def start_keyed_cluster(
    start_cluster, key_dir, admin_key: str, keys: dict[str, str], tenant_limits: str, **kwargs
):
    """A cluster whose router takes ``keys`` (tenant name -> data key) and ``admin_key``, with
    ``--tenant-limits tenant_limits``; ``kwargs`` go to ``start_cluster``."""
    key_file = key_dir / "api-keys"
    key_file.write_text("".join(f"{key} data tenant={name}\n" for name, key in keys.items()))
    local, _ = start_cluster(
        admin_api_key=admin_key,
        extra_router_flags=(
            *("--api-key-file", str(key_file)),
            *("--tenant-limits", tenant_limits),
        ),
        **kwargs,
    )
    return local
