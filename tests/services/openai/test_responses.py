"""``stop_reason`` as vLLM reports it, for each way a generation stops."""

from __future__ import annotations

import pytest

from services.router.openai.responses import ChoiceState
from splitserve.v1 import router_pb2

EOS = 2


def finished(token_ids: list[int], reason: int, stop_reason: str) -> router_pb2.GenerateResponse:
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
