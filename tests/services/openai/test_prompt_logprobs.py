"""The prompt's own logprobs through the cluster: completions' ``echo`` (with ``logprobs`` and
``max_tokens: 0``) and vLLM's ``prompt_logprobs`` on both APIs, through the official ``openai``
client, equal transformers' log-softmax of the prompt's logits (tiny model, float32, 1e-4),
whether the prefill worker or the decode worker (colocated) computed the prompt; gRPC clients
get them on the first message."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

from splitserve.v1 import router_pb2
from tests.services.openai.conftest import CLIENT_OPTIONS

NUM_TOP = 2


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 256) for _ in range(23)]  # ordinary tokens of the tiny vocabulary


def _reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """Row i: log P(. | prompt[: i + 1]), for i < len(prompt) - 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def detokenize(http_cluster):
    def text(token_ids: list[int]) -> str:
        url = f"{http_cluster[0].http_url}/detokenize"
        return httpx.post(url, json={"tokens": token_ids}, timeout=30).json()["prompt"]

    return text


def test_echo_logprobs_equal_transformers(sync_client, model, prompt, hf_model, detokenize):
    reference = _reference(hf_model, prompt)
    response = sync_client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0.0, echo=True, logprobs=NUM_TOP
    )
    (choice,) = response.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 4 == len(logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i, token_id in enumerate(prompt[1:]):
        row = reference[i]
        assert logprobs.token_logprobs[i + 1] == pytest.approx(row[token_id].item(), abs=1e-4)
        top = logprobs.top_logprobs[i + 1]
        values, ids = row.topk(NUM_TOP)
        # Keyed by text (the legacy shape): only tokens whose text no other entry has.
        texts = [detokenize([top_id]) for top_id in ids.tolist()]
        own = logprobs.tokens[i + 1]
        for text, value in zip(texts, values.tolist(), strict=True):
            if texts.count(text) == 1 and text != own:
                assert top[text] == pytest.approx(value, abs=1e-4)
    # The text is the prompt's then the generation's, and the offsets walk both.
    plain = sync_client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=NUM_TOP
    ).choices[0]
    assert choice.text.endswith(plain.text)
    assert logprobs.tokens[len(prompt) :] == plain.logprobs.tokens
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    assert response.usage.completion_tokens == 4


def test_echo_without_generation_is_the_prompt_alone(sync_client, model, prompt, detokenize):
    text = "The prompt comes back as it was sent"
    kwargs = {"model": model, "max_tokens": 0, "echo": True, "logprobs": 0}
    by_text = sync_client.completions.create(prompt=text, **kwargs)
    by_ids = sync_client.completions.create(prompt=[prompt, prompt[:5]], **kwargs)
    assert by_text.choices[0].text == text
    assert [c.text for c in by_ids.choices] == [detokenize(prompt), detokenize(prompt[:5])]
    assert [len(c.logprobs.tokens) for c in by_ids.choices] == [len(prompt), 5]
    for response in (by_text, by_ids):
        assert all(c.finish_reason == "length" for c in response.choices)
        assert response.usage.completion_tokens == 0


def test_streamed_echo_concatenates_to_the_whole_response(sync_client, model, prompt):
    kwargs = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0.0}
    whole = sync_client.completions.create(echo=True, logprobs=1, n=2, **kwargs)
    texts, tokens, values = ["", ""], [[], []], [[], []]
    for chunk in sync_client.completions.create(echo=True, logprobs=1, n=2, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                values[choice.index] += choice.logprobs.token_logprobs
    for i, choice in enumerate(whole.choices):
        assert texts[i] == choice.text
        assert tokens[i] == choice.logprobs.tokens
        assert values[i] == choice.logprobs.token_logprobs
    # Both choices echo the one prompt, computed once.
    assert (
        whole.choices[0].logprobs.token_logprobs[: len(prompt)]
        == (whole.choices[1].logprobs.token_logprobs[: len(prompt)])
    )


def _check_field(field, prompt: list[int], reference: torch.Tensor) -> None:
    """vLLM's prompt_logprobs: null, then per token its own entry and the top alternatives."""
    assert field[0] is None and len(field) == len(prompt)
    for i, token_id in enumerate(prompt[1:]):
        row, entry = reference[i], field[i + 1]
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(row[token_id].item(), abs=1e-4)
        assert own["rank"] == int((row > row[token_id]).sum()) + 1
        values, ids = row.topk(NUM_TOP)
        for rank, (top_id, value) in enumerate(
            zip(ids.tolist(), values.tolist(), strict=True), start=1
        ):
            assert entry[str(top_id)]["logprob"] == pytest.approx(value, abs=1e-4)
            if top_id != token_id:
                assert entry[str(top_id)]["rank"] == rank
        assert len(entry) <= NUM_TOP + 1


def test_prompt_logprobs_field_on_both_apis(sync_client, grpc_client, model, prompt, hf_model):
    completion = sync_client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=2,
        temperature=0.0,
        extra_body={"prompt_logprobs": NUM_TOP},
    )
    _check_field(
        completion.choices[0].model_extra["prompt_logprobs"], prompt, _reference(hf_model, prompt)
    )
    chat = sync_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=2,
        temperature=0.0,
        extra_body={"prompt_logprobs": NUM_TOP},
    )
    rendered = grpc_client.stub.Generate(
        router_pb2.GenerateRequest(
            messages=[router_pb2.ChatMessage(role="user", content="Say something")],
            sampling=router_pb2.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        )
    )
    first = next(iter(rendered))
    chat_prompt = list(first.prompt_token_ids)
    assert len(first.prompt_logprobs) == len(chat_prompt) - 1
    _check_field(
        chat.model_extra["prompt_logprobs"], chat_prompt, _reference(hf_model, chat_prompt)
    )


def test_the_decode_worker_computes_them_when_it_prefills(start_cluster, prompt, hf_model):
    cluster, _ = start_cluster(mode="colocated", num_decode=1)
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", **CLIENT_OPTIONS) as client:
        model = client.models.list().data[0].id
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=3,
            temperature=0.0,
            echo=True,
            logprobs=NUM_TOP,
            extra_body={"prompt_logprobs": NUM_TOP},
        )
    reference = _reference(hf_model, prompt)
    (choice,) = response.choices
    _check_field(choice.model_extra["prompt_logprobs"], prompt, reference)
    assert choice.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
        [reference[i][t].item() for i, t in enumerate(prompt[1:])], abs=1e-4
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_prompt_logprobs_requests_are_400s(sync_client, model, extra, param):
    body = {"model": model, "prompt": "hello", "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client.post("/completions", body=body, cast_to=httpx.Response)
    assert raised.value.body["param"] == param
