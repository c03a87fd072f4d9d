"""The official ``openai`` client against a real cluster's HTTP API: the same tokens as gRPC
``Generate``, usage (running usage per chunk too), several choices, stop strings, streaming
(sync and async); vLLM's ``/tokenize`` and ``/detokenize`` against what generation counts, and
``/metrics`` on the HTTP port."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.v1 import router_pb2
from tests.services.conftest import greedy

MAX_TOKENS = 12
PROMPT_IDS = list(range(40, 140))  # 100 tokens: several full KV blocks to cache


def _decoded(grpc_client, token_ids: list[int]) -> str:
    return grpc_client.generate(token_ids=token_ids, sampling=greedy(1)).text


def test_greedy_completion_is_token_identical_to_generate(sync_client, grpc_client, model):
    want = grpc_client.generate(token_ids=PROMPT_IDS, sampling=greedy(MAX_TOKENS, logprobs=2))
    got = sync_client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0, logprobs=2
    )
    choice = got.choices[0]
    assert choice.text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(PROMPT_IDS)
    assert got.usage.total_tokens == len(PROMPT_IDS) + len(want.token_ids)
    # Each token's logprob and alternatives are those of the gRPC stream's token ids.
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-6
    )
    assert len(choice.logprobs.tokens) == len(want.token_ids)
    # (Distinct ids may decode to the same text: a dict keyed by text can hold fewer than 3.)
    for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
        assert token in top and 1 <= len(top) <= 3
    assert choice.logprobs.text_offset[0] == 0
    assert choice.finish_reason == "length"


def test_greedy_chat_matches_generate_streaming_or_not(sync_client, grpc_client, model):
    messages = [{"role": "user", "content": "hello there"}]
    want = grpc_client.generate(
        messages=[router_pb2.ChatMessage(role="user", content="hello there")],
        sampling=greedy(MAX_TOKENS),
    )
    got = sync_client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == ("stop" if want.last.stop_reason else "length")
    # vLLM's stop_reason: null at eos and at a length stop.
    assert got.choices[0].model_extra["stop_reason"] is None
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == want.last.usage.prompt_tokens

    stream = sync_client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(sync_client, model):
    got = sync_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "go on"}]}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    usage = got.usage
    assert got.choices[0].finish_reason == "length"
    limits = sync_client.models.list().data[0]
    assert usage.prompt_tokens + usage.completion_tokens == limits.max_model_len


def test_async_streaming_completions_match_the_whole_response(async_client, model):
    async def run() -> tuple[str, str, list[str | None]]:
        async with async_client:
            whole = await async_client.completions.create(
                model=model, prompt="the async test", max_tokens=MAX_TOKENS, temperature=0
            )
            stream = await async_client.completions.create(
                model=model,
                prompt="the async test",
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            parts, reasons = [], []
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            return whole.choices[0].text, "".join(parts), reasons

    whole, streamed, reasons = asyncio.run(run())
    assert streamed == whole
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}


def test_async_chat_streaming_or_not_gives_the_same_answer(async_client, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

    async def run() -> tuple[str, str]:
        async with async_client:
            whole = await async_client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            stream = await async_client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            parts = [chunk.choices[0].delta.content or "" async for chunk in stream]
            return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert streamed == whole


def test_repeated_prompt_reports_cached_tokens(sync_client, model):
    prompt = list(range(300, 400))
    first = sync_client.completions.create(model=model, prompt=prompt, max_tokens=2)
    again = sync_client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(prompt)


def test_n_choices_with_a_seed_are_reproducible_and_distinct(sync_client, model):
    def three() -> list[str]:
        got = sync_client.completions.create(
            model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, n=3, seed=7
        )
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert got.usage.prompt_tokens == len(PROMPT_IDS)
        assert got.usage.completion_tokens == 24
        # The later choices ran after the first one's prefill: they hit its blocks.
        return [c.text for c in got.choices]

    first = three()
    assert three() == first
    assert len(set(first)) == 3


def test_n_choices_stream_interleaved_and_complete(sync_client, model):
    stream = sync_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "three ways"}],
        max_tokens=6,
        n=3,
        seed=3,
        stream=True,
    )
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    whole = sync_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "three ways"}], max_tokens=6, n=3, seed=3
    )
    assert [c.message.content for c in whole.choices] == [texts[i] for i in range(3)]


def test_stop_strings_cut_exactly(sync_client, grpc_client, model):
    base = (
        sync_client.completions.create(
            model=model, prompt="the stop test", max_tokens=20, temperature=0
        )
        .choices[0]
        .text
    )
    stop = base[len(base) // 2 :][:3]
    got = sync_client.completions.create(
        model=model, prompt="the stop test", max_tokens=20, temperature=0, stop=stop
    ).choices[0]
    assert got.text == base[: base.index(stop)]
    assert got.finish_reason == "stop"
    assert got.model_extra["stop_reason"] == stop
    want = grpc_client.generate(prompt="the stop test", sampling=greedy(20, stop=[stop]))
    assert got.text == want.text


def test_a_stop_token_id_is_the_stop_reason(sync_client, grpc_client, model):
    first_id = grpc_client.generate(token_ids=PROMPT_IDS, sampling=greedy(1)).token_ids[0]
    got = sync_client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [first_id]},
    ).choices[0]
    assert (got.finish_reason, got.text) == ("stop", "")
    assert got.model_extra["stop_reason"] == first_id


def test_batch_of_prompts_gives_one_choice_per_prompt_in_order(sync_client, grpc_client, model):
    prompts = ["first prompt", "second prompt"]
    got = sync_client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
    want = [grpc_client.generate(prompt=p, sampling=greedy(4)).text for p in prompts]
    assert [c.text for c in got.choices] == want
    assert [c.index for c in got.choices] == [0, 1]


def test_models_health_and_version(sync_client, base_url, model):
    import urllib.request

    models = sync_client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].max_model_len > 0
    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{root}/version", timeout=10) as reply:
        assert reply.status == 200 and b"version" in reply.read()


def test_continuous_usage_counts_every_chunks_tokens_so_far(sync_client, grpc_client, model):
    """vLLM's ``continuous_usage_stats``: each chunk's usage is the prompt's tokens and its
    choice's tokens so far (each chunk's logprob entries are its tokens); gRPC messages carry
    the same running usage."""
    stream = sync_client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    num_tokens = 0
    for chunk in chunks[:-1]:
        num_tokens += len(chunk.choices[0].logprobs.tokens)
        assert chunk.usage.prompt_tokens == len(PROMPT_IDS)
        assert chunk.usage.completion_tokens == num_tokens
        assert chunk.usage.total_tokens == len(PROMPT_IDS) + num_tokens
    assert num_tokens == MAX_TOKENS and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS

    generated = grpc_client.generate(
        token_ids=PROMPT_IDS, sampling=greedy(MAX_TOKENS, ignore_eos=True)
    )
    num_tokens = 0
    for message in generated.messages:
        num_tokens += len(message.token_ids)
        assert message.usage.prompt_tokens == len(PROMPT_IDS)
        assert message.usage.completion_tokens == num_tokens


def test_tokenize_counts_what_generation_counts_and_detokenize_inverts_it(sync_client, model):
    import httpx

    root = str(sync_client.base_url).removesuffix("/").removesuffix("/v1")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = sync_client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0
    )
    with httpx.Client(base_url=root, timeout=30) as http:
        tokenized = http.post("/tokenize", json={"model": model, "messages": messages}).json()
        assert tokenized["count"] == len(tokenized["tokens"]) == chat.usage.prompt_tokens
        assert tokenized["max_model_len"] > tokenized["count"] and tokenized["token_strs"] is None
        rendered = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        assert "What is the capital of France?" in rendered
        # Without the assistant's turn the rendering is a prefix of the one with it.
        bare = http.post(
            "/tokenize", json={"messages": messages, "add_generation_prompt": False}
        ).json()["tokens"]
        assert bare == tokenized["tokens"][: len(bare)] and len(bare) < tokenized["count"]

        text = "The capital of France is"
        completion = sync_client.completions.create(
            model=model, prompt=text, max_tokens=1, temperature=0
        )
        plain = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert plain["count"] == completion.usage.prompt_tokens
        assert len(plain["token_strs"]) == plain["count"]
        bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert http.post("/detokenize", json=bare).json()["prompt"] == text

        vocab_size = max(plain["tokens"]) + 10**7
        refused = http.post("/detokenize", json={"tokens": [3, vocab_size]})
        assert refused.status_code == 400 and "tokens[1]" in refused.json()["error"]["message"]
        both = http.post("/tokenize", json={"prompt": text, "messages": messages})
        assert both.status_code == 400
        other = http.post("/tokenize", json={"model": "another", "prompt": text})
        assert other.status_code == 404


def test_metrics_and_a_fresh_created_stamp_on_the_http_port(sync_client, model):
    import time

    import httpx

    before_s = int(time.time())
    completion = sync_client.completions.create(model=model, prompt="hi", max_tokens=1)
    assert before_s <= completion.created <= time.time()
    root = str(sync_client.base_url).removesuffix("/").removesuffix("/v1")
    reply = httpx.get(f"{root}/metrics", timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    assert "splitserve_router_requests_total" in reply.text
    assert 'vllm:e2e_request_latency_seconds_count{model_name="' in reply.text
