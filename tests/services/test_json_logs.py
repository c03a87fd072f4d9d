"""``--log-format json`` on a real cluster: every line the router writes parses, and each
finished request is one line with its numbers."""

from __future__ import annotations

import json

import pytest

from services.common.logs import LOG_FORMAT_ENV
from services.launcher import LocalCluster
from splitserve.v1 import router_pb2
from tests.services.conftest import Client, greedy, tiny_engine_config
from tests.waiting import wait_until

PROMPT = list(range(30, 70))


@pytest.fixture(scope="module")
def json_cluster(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(LOG_FORMAT_ENV, "json")  # the launcher's children inherit it
        cluster = LocalCluster(engine=tiny_engine_config(tiny_llama_dir), log_level="INFO")
        try:
            cluster.start(timeout_s=180)
            client = Client(cluster.router_address)
            yield cluster, client
            client.close()
        finally:
            cluster.stop()


def test_router_lines_are_json_and_a_request_is_one_line(json_cluster):
    cluster, client = json_cluster
    got = client.generate(token_ids=PROMPT, sampling=greedy(6), request_id="my-label")
    router = cluster.workers("router")[0]

    def request_line() -> dict | None:
        entries = [json.loads(line) for line in list(router.stderr_tail)]
        return next((e for e in entries if e.get("request_id") == "my-label"), None)

    line = wait_until(request_line, 30, "the router's line for the request")
    assert line["logger"] == "splitserve.requests" and line["level"] == "INFO"
    assert line["outcome"] == "length" and line["output_tokens"] == len(got.token_ids) == 6
    assert line["finish_reason"] == "length" and line["status"] == "OK"
    assert line["prompt_tokens"] == len(PROMPT)
    assert line["cached_tokens"] == got.last.usage.cached_tokens
    assert 0 < line["ttft_ms"] <= line["e2e_ms"]
    prefill, decode = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    assert line["prefill_worker"] == prefill.address
    assert line["decode_workers"] == [decode.address]
    assert len(line["req_id"]) == 32 and line["req_id"] in line["message"]
    for worker in (prefill, decode):
        lines = list(worker.stderr_tail)
        assert lines and all(json.loads(line)["level"] for line in lines)


def test_a_stream_the_client_cancels_is_a_line_with_its_status(json_cluster):
    cluster, client = json_cluster
    call = client.stub.Generate(
        router_pb2.GenerateRequest(
            token_ids=PROMPT, sampling=greedy(900, ignore_eos=True), request_id="goes-away"
        ),
        timeout=60,
    )
    assert next(call).token_ids
    call.cancel()
    router = cluster.workers("router")[0]

    def request_line() -> dict | None:
        entries = [json.loads(line) for line in list(router.stderr_tail)]
        return next((e for e in entries if e.get("request_id") == "goes-away"), None)

    line = wait_until(request_line, 30, "the router's line for the cancelled request")
    assert line["outcome"] == "cancelled" and line["finish_reason"] == ""
    assert line["status"] == "CANCELLED" and 0 < line["output_tokens"] < 900
    client.wait_idle()
