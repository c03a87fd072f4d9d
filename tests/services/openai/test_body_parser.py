"""``BodyParser``: large bodies parse in a helper process to the same model the inline parse
gives, refusals come back as the same 400s, and the event loop runs on meanwhile."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from http import HTTPStatus

import pytest

from services.router.openai.body_parser import BodyParser
from services.router.openai.errors import OpenAIError
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.services.openai.loop_ticks import LoopTicks

LARGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def parser() -> Iterator[BodyParser]:
    bodies = BodyParser(share=1.0, large_body_bytes=LARGE_BYTES)
    yield bodies
    bodies.close()


def _chat(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_a_large_body_parses_as_the_inline_parse_does(parser: BodyParser) -> None:
    data = json.dumps({"prompt": list(range(30_000)), "max_tokens": 3, "n": 2}).encode()
    assert len(data) > LARGE_BYTES

    async def run() -> tuple[CompletionRequest, int]:
        async with LoopTicks() as ticks:
            body = await parser.parse(CompletionRequest, data)
        return body, ticks.count

    body, ticks = asyncio.run(run())
    assert body == CompletionRequest.model_validate_json(data)
    # The loop ran other tasks while the helper parsed (inline, it would have held it).
    assert ticks > 100


def test_a_small_body_parses_inline(parser: BodyParser) -> None:
    data = _chat(max_tokens=4)
    body = asyncio.run(parser.parse(ChatCompletionRequest, data))
    assert body == ChatCompletionRequest.model_validate_json(data)


def test_a_large_constraint_over_its_budget_comes_back_as_its_400(parser: BodyParser) -> None:
    data = _chat(guided_choice=[f"choice {i}" for i in range(100_000)])
    assert len(data) > LARGE_BYTES
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(parser.parse(ChatCompletionRequest, data))
    assert refused.value.status == HTTPStatus.BAD_REQUEST
    assert refused.value.param == "guided_choice"
    assert refused.value.message == "guided_choice: 100000 choices, more than 10000"


@pytest.mark.parametrize("large", [False, True])
def test_a_malformed_body_is_the_same_400_inline_and_in_the_helper(
    parser: BodyParser, large: bool
) -> None:
    data = _chat(max_tokens="many", user="x" * (LARGE_BYTES if large else 0))
    assert (len(data) > LARGE_BYTES) == large
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(parser.parse(ChatCompletionRequest, data))
    assert refused.value.status == HTTPStatus.BAD_REQUEST
    assert refused.value.param == "max_tokens"
