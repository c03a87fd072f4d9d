"""Router pieces without processes: request validation, the response stream, torch-freedom,
the router's id."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from services.common.tracing import TracingConfig
from services.router.config import RouterConfig
from services.router.request_prep import ModelLimits, RequestBounds, prepare_request
from services.router.response_stream import ResponseStream
from services.router.server import RouterServicer
from splitserve.v1 import router_pb2
from tests.services.router.fakes import BLOCK_SIZE, DECODE, PREFILL, W

LIMITS = ModelLimits(vocab_size=489, max_model_len=64)
_sp = router_pb2.SamplingParams
_chat = router_pb2.ChatMessage


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer(tiny_llama_dir)


def test_router_modules_do_not_import_torch():
    code = (
        "import sys, services.router.app, services.client, services.launcher; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


BOUNDS = RequestBounds(max_prompt_bytes=64, max_messages=2)


def test_prepare_applies_defaults_and_generates_an_id(tokenizer):
    prepared = prepare_request(router_pb2.GenerateRequest(prompt="hello"), tokenizer, LIMITS)
    assert prepared.prompt_token_ids == tokenizer.encode("hello")
    assert prepared.params == SamplingParams()
    assert len(prepared.req_id) == 32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(token_ids=[1] * 64), "prompt: 64 tokens do not fit the context of 64"),
        (dict(token_ids=[1] * 60, sampling=_sp(max_tokens=5)), "sampling.max_tokens: 5 + 60"),
        (dict(token_ids=[1], sampling=_sp(stop_token_ids=[489])), "sampling.stop_token_ids"),
        (dict(request_id="x" * 300, prompt="a"), "request_id"),
        (dict(prompt="é" * 40), "prompt: 80 bytes, more than 64"),
        (dict(messages=[_chat(role="user", content="b")] * 3), "messages: 3 messages, more than 2"),
        (dict(prompt="a", messages=[_chat(role="user", content="b")]), "only one of"),
    ],
)  # fmt: skip
def test_prepare_rejects_with_the_field_name(tokenizer, fields, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        prepare_request(router_pb2.GenerateRequest(**fields), tokenizer, LIMITS, BOUNDS)


def test_response_stream_text_equals_offline_detokenization(tiny_llama_dir, tokenizer):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, max_model_len=512)
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0.0, max_tokens=15)
    want = llm.generate([prompt], params)[0]
    stream = ResponseStream("r", tokenizer, prompt, params)
    messages = [stream.push([t]) for t in want.token_ids[:-1]]
    messages.append(stream.push(want.token_ids[-1:], finish_reason="length"))
    assert "".join(m.text for m in messages) == want.text
    assert messages[-1].finish_reason == router_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 15

    stop = want.text[4:7]
    cut = SamplingParams(temperature=0.0, max_tokens=15, stop=[stop])
    want_cut = llm.generate([prompt], cut)[0]
    stream = ResponseStream("r", tokenizer, prompt, cut)
    # Tokens arrive in one batch: the ones after the stop string's token are dropped.
    message = stream.push(want.token_ids)
    assert stream.finished and message.stop_reason == stop
    assert list(message.token_ids) == want_cut.token_ids and message.text == want_cut.text


def test_response_stream_stop_token_adds_no_text(tokenizer):
    stream = ResponseStream("r", tokenizer, [5], SamplingParams())
    message = stream.push([0], finish_reason="stop", stop_reason="0")
    assert message.text == "" and list(message.token_ids) == [0]
    assert message.finish_reason == router_pb2.FINISH_REASON_STOP


def test_the_traces_name_the_router_by_the_id_of_its_ledger_entries(tokenizer):
    """Without --router-id the id is made up once: the service.instance.id of the router's
    spans is the router its reservations name."""

    async def main() -> None:
        # Nothing listens there; no span is ended, so nothing is sent.
        tracing = TracingConfig(otlp_traces_endpoint="127.0.0.1:1")
        config = RouterConfig(model="unused", tracing=tracing)
        servicer = RouterServicer(config, tokenizer)
        servicer.prefill_pool.workers = [W("p0").build(PREFILL)]
        servicer.decode_pool.workers = [W("d0").build(DECODE)]
        plan = await servicer.planner.plan("req-1", list(range(3, 3 + 4 * BLOCK_SIZE)))
        assert plan.prefill.reservation is not None
        ledger_router_id = plan.prefill.reservation.member.split("|")[0]
        span = servicer.tracing.start_request_span("generate", (), {})
        assert span.resource.attributes["service.instance.id"] == ledger_router_id  # type: ignore[attr-defined]
        assert ledger_router_id == servicer.router_id
        await servicer.tracing.shutdown()
        await servicer.planner.prefill_chooser.close()

    asyncio.run(main())
