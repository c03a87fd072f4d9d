"""``--engine mock``: the native engine's scheduling and block pool over a simulated executor.
Its ids depend on the prompt and position alone (so a request continues with the same ids on
another engine), it writes every computed token's KV as ``kv_value``, and its steps take the
profile's time."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig, EngineKind
from engine.kv_cache_manager import cdiv
from engine.sampler import SamplerOutput
from engine.scheduler_output import ScheduledRequest
from engine.simulated import StepProfile, kv_matches, prompt_digest, simulated_token_id

PROMPT = list(range(5, 45))  # 40 tokens: 2.5 blocks of 16


def _mock(model_dir: Path, **fields: object) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir),
        engine=EngineKind.MOCK,
        num_kv_blocks=64,
        check_kv_integrity=True,
        num_speculative_tokens=0,
        **fields,  # type: ignore[arg-type]
    )
    return LLMEngine(config)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    return tokens


def test_ids_depend_on_the_prompt_and_position_alone(tiny_llama_dir: Path) -> None:
    engine = _mock(tiny_llama_dir)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    engine.add_request("alone", PROMPT, params)
    alone = _run(engine)["alone"]
    # The same prompt beside others, in a batch of another shape, and another prompt.
    engine.add_request("again", PROMPT, params)
    engine.add_request("other", [7, *PROMPT], params)
    together = _run(engine)
    assert together["again"] == alone and len(alone) == 12
    assert together["other"] != alone
    digest = prompt_digest(PROMPT)
    eos = engine.tokenizer.eos_token_ids
    assert alone == [simulated_token_id(digest, i, engine.vocab_size, eos) for i in range(12)]
    assert not set(alone) & eos


def test_prompt_logprobs_are_each_prompt_tokens_alone_in_chunks_too(tiny_llama_dir: Path) -> None:
    engine = _mock(tiny_llama_dir, max_num_batched_tokens=16)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=3))
    (first,) = [out for out in _drain(engine) if out.new_token_ids][:1]
    assert [entry.token_id for entry in first.prompt_logprobs] == PROMPT[1:]
    assert all(entry.logprob == 0.0 and entry.rank == 1 for entry in first.prompt_logprobs)


def _drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_a_request_resumed_on_another_engine_continues_with_the_same_ids(
    tiny_llama_dir: Path,
) -> None:
    first, second = _mock(tiny_llama_dir), _mock(tiny_llama_dir)
    first.add_request("r", PROMPT, SamplingParams(max_tokens=10))
    whole = _run(first)["r"]
    second.add_request("r", PROMPT, SamplingParams(max_tokens=10), output_token_ids=whole[:4])
    assert _run(second)["r"] == whole[4:]


def test_held_kv_holds_each_tokens_value_and_a_copy_of_it_matches(tiny_llama_dir: Path) -> None:
    prefill, decode = _mock(tiny_llama_dir), _mock(tiny_llama_dir)
    prefill.add_request("r", PROMPT, SamplingParams(max_tokens=1), hold_kv=True)
    first_token = _run(prefill)["r"]
    held = prefill.held_kv_block_ids("r")
    assert len(held) == cdiv(len(PROMPT), 16)
    assert kv_matches(prefill.kv_cache, held, PROMPT, 16)
    assert not kv_matches(prefill.kv_cache, held, [PROMPT[0] + 1, *PROMPT[1:]], 16)
    # What a KV backend does: the held blocks' bytes into the blocks the decode engine loads.
    _add_pulled(decode, first_token)
    decode.step()
    (load,) = decode.take_kv_loads()
    decode.kv_cache[load.block_ids] = prefill.kv_cache[held]
    decode.finish_kv_load("r", True)
    assert kv_matches(decode.kv_cache, load.block_ids, PROMPT, 16)
    assert len(_run(decode)["r"]) == 3


def test_pulled_kv_with_a_wrong_byte_fails_its_request_alone(tiny_llama_dir: Path) -> None:
    prefill, decode = _mock(tiny_llama_dir), _mock(tiny_llama_dir)
    prefill.add_request("r", PROMPT, SamplingParams(max_tokens=1), hold_kv=True)
    first_token = _run(prefill)["r"]
    held = prefill.held_kv_block_ids("r")
    _add_pulled(decode, first_token)
    decode.add_request("other", [7, *PROMPT], SamplingParams(max_tokens=4))
    decode.step()
    (load,) = decode.take_kv_loads()
    decode.kv_cache[load.block_ids] = prefill.kv_cache[held]
    decode.kv_cache[load.block_ids[-1]].view(-1)[0] += 1  # one byte the transfer got wrong
    decode.finish_kv_load("r", True)
    finals = {}
    while decode.has_unfinished_requests():
        finals.update({out.req_id: out for out in decode.step() if out.finished})
    assert finals["r"].error is not None and "wrong bytes" in finals["r"].error
    assert finals["other"].error is None and len(finals["other"].token_ids) == 4


def test_prefix_caching_hits_as_on_the_native_engine(tiny_llama_dir: Path) -> None:
    engine = _mock(tiny_llama_dir)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2))
    _run(engine)
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=2))
    (first,) = engine.step()
    # Every whole block of the prompt is a hit (the last token is always computed).
    assert first.num_cached_tokens == len(PROMPT) // 16 * 16


@pytest.mark.parametrize("num_requests", [1, 8], ids=["one", "batch-of-8"])
def test_steps_take_the_profiles_time_within_10_percent(
    tiny_llama_dir: Path, num_requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = StepProfile(
        overhead_s=0.02, prefill_s_per_token=2e-4, decode_s_per_seq=2e-3, kv_read_s_per_block=5e-4
    )
    engine = _mock(
        tiny_llama_dir,
        mock_step_ms=profile.overhead_s * 1e3,
        mock_prefill_us_per_token=profile.prefill_s_per_token * 1e6,
        mock_decode_us_per_seq=profile.decode_s_per_seq * 1e6,
        mock_kv_read_us_per_block=profile.kv_read_s_per_block * 1e6,
    )
    # What each step's batch should take, by the profile, as the engine hands it over.
    priced: list[float] = []
    run = engine.executor.run

    def priced_run(scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        priced.append(profile.step_s(scheduled, 16))
        return run(scheduled)

    monkeypatch.setattr(engine.executor, "run", priced_run)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [i + 3, *PROMPT], SamplingParams(max_tokens=6))
    ratios = []
    while engine.has_unfinished_requests():
        start_s = time.perf_counter()
        engine.step()
        ratios.append((time.perf_counter() - start_s) / priced[-1])
    # The whole step (scheduling and bookkeeping included) is the profile's time.
    assert len(ratios) >= 6
    assert 0.9 <= statistics.median(ratios) <= 1.1, ratios


def _add_pulled(decode: LLMEngine, first_token: list[int]) -> None:
    """Queue request "r" as a decode worker does after a prefill: its prompt's KV to load."""
    decode.add_request(
        "r",
        PROMPT,
        SamplingParams(max_tokens=4),
        output_token_ids=first_token,
        num_external_tokens=len(PROMPT),
    )
