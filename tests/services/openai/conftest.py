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
