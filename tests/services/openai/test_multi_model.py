"""Two models behind one router through the official ``openai`` client: the router learns the
second model from the worker reporting it, ``/v1/models`` lists both, each request reaches its
model's worker only, ``/tokenize`` uses the named model's tokenizer, and a missing model is a
404 naming both."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer
from loadtest.fixtures.tiny_model import TEST_SPEC, make_tiny_model
from tests.services.openai.standin import (
    StandInDecodeWorker,
    standin_router,
    vocab_size,
    wait_for,
)

OTHER = "tiny-qwen2"


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A qwen2 model with a smaller vocabulary than the tiny llama: its own tokenizer."""
    spec = dataclasses.replace(TEST_SPEC, vocab_size=300)
    return make_tiny_model(tmp_path_factory.mktemp("other") / "qwen2", "qwen2", spec=spec)


def test_each_model_is_listed_and_answered_by_its_own_worker(tiny_llama_dir, other_dir):
    primary_worker = StandInDecodeWorker(vocab_size(tiny_llama_dir))
    other_worker = StandInDecodeWorker(vocab_size(other_dir))
    other_worker.model, other_worker.model_path = OTHER, str(other_dir)
    primary = str(tiny_llama_dir)

    async def run() -> None:
        async with standin_router(tiny_llama_dir, primary_worker, (other_worker,)) as router:
            models = router.servicer.models
            await wait_for(lambda: OTHER in models.names(), 30, "the other model learnt")
            base_url = f"http://127.0.0.1:{router.http_port}/v1"
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
            listed = {m.id: m for m in (await client.models.list()).data}
            assert list(listed) == [primary, OTHER]
            assert listed[OTHER].model_extra["root"] == str(other_dir)
            assert listed[OTHER].model_extra["max_model_len"] is not None

            reply = await client.completions.create(model=OTHER, prompt="hello", max_tokens=3)
            assert reply.model == OTHER and reply.usage.completion_tokens == 3
            assert (primary_worker.num_calls, other_worker.num_calls) == (0, 1)
            reply = await client.completions.create(model=primary, prompt="hello", max_tokens=2)
            assert reply.model == primary
            assert (primary_worker.num_calls, other_worker.num_calls) == (1, 1)

            with pytest.raises(openai.NotFoundError) as info:
                await client.completions.create(model="nope", prompt="x", max_tokens=1)
            assert f"`{primary}`, `{OTHER}`" in info.value.body["message"]

            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
                text = "The capital of France"
                tokens = await http.post("/tokenize", json={"model": OTHER, "prompt": text})
                expected = Tokenizer(other_dir).encode(text)
                assert expected != Tokenizer(tiny_llama_dir).encode(text)
                assert tokens.json()["tokens"] == expected
            await client.close()

    asyncio.run(run())
