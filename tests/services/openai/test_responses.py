"""``stop_reason`` as vLLM reports it, for each way a generation stops, and the whole
(non-streaming) body, written in pieces, as ``JSONResponse`` renders the same object."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.responses import JSONResponse

from services.router.openai.choices import ChoiceMessage
from services.router.openai.requests import Endpoint, GenerationPlan
from services.router.openai.responses import ChoiceState, ResponseBuilder
from services.router.request_prep import MaxTokensDefault
from splitserve.v1 import router_pb2, worker_pb2

EOS = 2


def finished(
    token_ids: list[int], reason: router_pb2.FinishReason, stop_reason: str
) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(
        token_ids=token_ids, text="x", finish_reason=reason, stop_reason=stop_reason
    )


@pytest.mark.parametrize(
    ("eos_only_ids", "message", "want"),
    [
        # The model's eos: null, as vLLM.
        ({EOS}, finished([5, EOS], router_pb2.FINISH_REASON_STOP, str(EOS)), None),
        # The same id asked for in stop_token_ids: that id.
        (set(), finished([5, EOS], router_pb2.FINISH_REASON_STOP, str(EOS)), EOS),
        # A stop string, even one of digits.
        ({EOS}, finished([5, 7], router_pb2.FINISH_REASON_STOP, "42"), "42"),
        ({EOS}, finished([5, 7], router_pb2.FINISH_REASON_STOP, "Paris"), "Paris"),
        ({EOS}, finished([5, 7], router_pb2.FINISH_REASON_LENGTH, ""), None),
    ],
)
def test_stop_reason(eos_only_ids, message, want):
    state = ChoiceState(0, frozenset(eos_only_ids))
    state.add(message)
    assert state.stop_reason == want
    assert state.finish_reason in ("stop", "length") and state.num_tokens == 2


# ---------------------------------------------------------------------------- whole bodies
# Token texts with JSON escapes, non-ASCII and a repeat ("a"): the legacy top_logprobs map
# keeps one entry per text.
TEXTS = ["a", "é", "日本", '"q"', "\\", "a"]
NUM_TOKENS = 70  # more than one piece of logprob entries


class FakeTexts:
    eos_token_ids = frozenset({EOS})

    @staticmethod
    def text(token_id: int) -> str:
        return TEXTS[token_id % len(TEXTS)]


def entry(i: int) -> tuple[int, float, list[tuple[int, float]]]:
    """Token i's id, logprob and two alternatives."""
    return i % 6, -0.25 * (i % 5), [((i + 1) % 6, -1.5), ((i + 5) % 6, -2.0)]


def generated(index: int) -> list[ChoiceMessage]:
    items = []
    for i in range(NUM_TOKENS):
        token_id, logprob, top = entry(i)
        message = router_pb2.GenerateResponse(token_ids=[token_id], text=FakeTexts.text(token_id))
        message.logprobs.append(
            worker_pb2.TokenLogprob(
                token_id=token_id,
                logprob=logprob,
                top=[worker_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
            )
        )
        if i + 1 == NUM_TOKENS:
            message.finish_reason = router_pb2.FINISH_REASON_LENGTH
            message.usage.prompt_tokens = 3
        items.append(ChoiceMessage(index, message))
    return items


def expected_logprobs(endpoint: Endpoint) -> dict[str, Any]:
    text = FakeTexts.text
    entries = [entry(i) for i in range(NUM_TOKENS)]
    if endpoint is Endpoint.CHAT:

        def token(token_id: int, logprob: float) -> dict[str, Any]:
            return {
                "token": text(token_id),
                "logprob": logprob,
                "bytes": list(text(token_id).encode()),
            }

        return {
            "content": [
                {**token(t, lp), "top_logprobs": [token(*alt) for alt in top]}
                for t, lp, top in entries
            ]
        }
    tops = []
    for t, lp, top in entries:
        by_text = {text(alt): alt_lp for alt, alt_lp in top}
        by_text.setdefault(text(t), lp)
        tops.append(by_text)
    tokens = [text(t) for t, _, _ in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": tops,
        "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(NUM_TOKENS)],
    }


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_a_whole_body_in_pieces_is_what_json_response_renders(endpoint):
    request = router_pb2.GenerateRequest()
    plan = GenerationPlan(endpoint, ((request, request),), MaxTokensDefault.ENGINE)
    builder = ResponseBuilder(plan, "id-1", "tiny", 5, FakeTexts())
    first, second = generated(0), generated(1)
    for item in (m for pair in zip(first, second, strict=True) for m in pair):
        builder.add(item)
    text = "".join(TEXTS[i % len(TEXTS)] for i in range(NUM_TOKENS))
    choices = []
    for index in (0, 1):
        choice: dict[str, Any] = {"index": index}
        if endpoint is Endpoint.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {
            "logprobs": expected_logprobs(endpoint),
            "finish_reason": "length",
            "stop_reason": None,
        }
        choices.append(choice)
    want = {
        "id": "id-1",
        "object": endpoint.value,
        "created": 5,
        "model": "tiny",
        "choices": choices,
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2 * NUM_TOKENS,
            "total_tokens": 3 + 2 * NUM_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    pieces = list(builder.body())
    assert "".join(pieces).encode() == JSONResponse(want).body
    assert len(pieces) > 2 * (NUM_TOKENS // 64 + 1)
