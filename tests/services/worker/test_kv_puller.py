"""``KVPullHooks`` keeps nothing for a request that ends without taking its pull's result."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.services.test_disaggregated_engines import Pair, make_prompts


@pytest.fixture
def pair(tiny_llama_dir):
    pair = Pair(tiny_llama_dir)
    yield pair
    pair.close()


def test_abort_during_a_pull_frees_everything_and_keeps_no_result(pair):
    prompt = make_prompts(lens=(40,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    first = pair.run_prefill("r0", prompt, params)
    assert pair.puller.expect("r0", pair.kv_ref("r0", len(prompt)), pair.peer)
    pair.decode.add_request(
        "r0", prompt, params, output_token_ids=first.token_ids, num_external_tokens=len(prompt)
    )
    outputs = pair.decode.step()  # admits it: its blocks are allocated, the pull starts
    pair.puller.after_step(pair.decode, outputs)
    assert pair.puller.busy
    assert pair.puller.abort(pair.decode, "r0") == []  # freed once the read ends, not before
    while pair.puller.busy:
        pair.puller.before_step(pair.decode)
    assert not pair.decode.has_unfinished_requests()
    assert pair.decode.stats().num_used_blocks == 0
    assert pair.puller.take_result("r0") is None
    pair.decode.kv_cache_manager.check_integrity()
    # The source saw the release: its lease ends and its blocks are freed.
    pair.leases.before_step(pair.prefill)
    pair.free_released_leases()
    assert pair.leases.num_leases == 0 and pair.prefill.stats().num_used_blocks == 0
