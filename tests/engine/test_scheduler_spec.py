"""Draft tokens in the scheduler (``engine.ngram_proposer``): which decodes carry drafts, how
many, and what ``update_from_output`` keeps of them. A real ``Scheduler`` and ``KVCacheManager``,
samples chosen by the test (``scheduler_script``)."""

from __future__ import annotations

from engine.ngram_proposer import NgramProposer
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.engine.scheduler_script import BLOCK_SIZE, EOS, check_batch, make_scheduler, req

# A prompt that repeats: after it, the lookup of "1 2" drafts "3 4 5".
PROMPT = (1, 2, 3, 4, 5, 9, 1, 2)


def scheduler_with_drafts(num_speculative_tokens: int = 3, **config: int) -> Scheduler:
    proposer = NgramProposer(num_speculative_tokens, prompt_lookup_min=1, prompt_lookup_max=2)
    return make_scheduler(proposer=proposer, **config)  # type: ignore[arg-type]


def prefill(scheduler: Scheduler, *requests: Request, first_token: int = 1) -> None:
    """Admit and prefill ``requests``; each samples ``first_token``."""
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert all(not item.spec_token_ids for item in out.scheduled)
    scheduler.update_from_output(out, [first_token] * len(out.scheduled))


def decode(scheduler: Scheduler, samples: list[int]):
    """One step whose model samples ``samples`` (one per row, in row order); returns the step,
    the ids each item computed, and the update's (updated, finished) requests."""
    out = scheduler.schedule()
    check_batch(scheduler, out)
    assert sum(item.num_sample_rows for item in out.scheduled) == len(samples)
    token_ids = [item.token_ids for item in out.scheduled]
    updated, finished = scheduler.update_from_output(out, samples)
    scheduler.kv_cache_manager.check_integrity()
    return out, token_ids, updated, finished


def greedy(req_id: str, prompt: tuple[int, ...] = PROMPT[:-1], **kwargs: object) -> Request:
    return req(req_id, prompt, temperature=0.0, **kwargs).build()


def test_a_greedy_decode_carries_drafts_and_keeps_the_matching_ones_plus_one():
    scheduler = scheduler_with_drafts()
    a = greedy("A", ignore_eos=True)
    prefill(scheduler, a, first_token=2)  # tokens end "... 1 2": drafts 3 4 5
    out, token_ids, updated, _ = decode(scheduler, [3, 4, 8, 6])
    (item,) = out.scheduled
    assert item.spec_token_ids == (3, 4, 5) and item.num_new_tokens == 4
    assert token_ids == [[2, 3, 4, 5]]
    # 3 and 4 stand, 5 is replaced by the sample after 4; the KV of 2, 3 and 4 is kept.
    assert updated == [a] and a.output_token_ids == [2, 3, 4, 8]
    assert a.num_computed_tokens == a.num_tokens - 1
    assert scheduler.num_draft_tokens == 3 and scheduler.num_accepted_tokens == 2


def test_all_drafts_accepted_gives_one_more_and_a_miss_gives_one():
    scheduler = scheduler_with_drafts()
    a = greedy("A", ignore_eos=True)
    prefill(scheduler, a, first_token=2)
    decode(scheduler, [3, 4, 5, 9])
    assert a.output_token_ids == [2, 3, 4, 5, 9]
    (item,) = decode(scheduler, [11, 12, 13, 14])[0].scheduled
    assert item.spec_token_ids == (1, 2, 3)  # "5 9" seen before: then "1 2 3"
    assert a.output_token_ids[-1] == 11 and a.num_computed_tokens == a.num_tokens - 1


def test_no_drafts_for_sampled_requests_or_without_a_proposer():
    scheduler = scheduler_with_drafts()
    prefill(scheduler, req("S", PROMPT[:-1], ignore_eos=True).build(), first_token=2)
    out, _, _, _ = decode(scheduler, [3])
    assert out.scheduled[0].spec_token_ids == ()
    plain = make_scheduler()
    prefill(plain, greedy("G", ignore_eos=True), first_token=2)
    assert plain.schedule().scheduled[0].spec_token_ids == ()


def test_drafts_stop_short_of_max_tokens_and_the_budget():
    scheduler = scheduler_with_drafts(num_speculative_tokens=5)
    a = greedy("A", max_tokens=3, ignore_eos=True)
    prefill(scheduler, a, first_token=2)
    out, _, _, finished = decode(scheduler, [3, 4])
    assert out.scheduled[0].spec_token_ids == (3,)  # room for one draft and the bonus token
    assert finished == [a] and a.output_token_ids == [2, 3, 4]
    assert a.status is RequestStatus.FINISHED_LENGTH_CAPPED
    tight = scheduler_with_drafts(num_speculative_tokens=5, max_num_batched_tokens=3)
    b = greedy("B", prompt=(1, 2))
    prefill(tight, b, first_token=1)  # "1 2 1": drafts "2 1" at most (budget 3)
    assert tight.schedule().scheduled[0].spec_token_ids == (2, 1)


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    scheduler = scheduler_with_drafts()
    a = greedy("A", prompt=(1, 5, EOS, 4, 6))
    prefill(scheduler, a, first_token=1)  # "... 6 1": "1" drafts "5 EOS 4"
    # The samples accept 5 and EOS: the request stops at EOS, 4 is never appended.
    _, _, _, finished = decode(scheduler, [5, EOS, 4, 6])
    assert finished == [a] and a.output_token_ids == [1, 5, EOS]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == EOS
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_out_of_blocks_a_decode_drops_its_drafts_before_preempting():
    # 3 blocks of 4 tokens: A's next decode fits (10 tokens), with its 3 drafts it would not.
    scheduler = scheduler_with_drafts(num_blocks=3)
    a = greedy("A", prompt=(1, 2, 3, 4, 5, 9, 7, 1, 2), ignore_eos=True)
    prefill(scheduler, a, first_token=3)
    out, _, _, _ = decode(scheduler, [4])
    assert out.preempted_req_ids == [] and out.scheduled[0].spec_token_ids == ()
    assert a.output_token_ids == [3, 4] and a.status is RequestStatus.RUNNING
    assert len(scheduler.kv_cache_manager.get_block_ids("A")) * BLOCK_SIZE >= a.num_tokens - 1
