"""The router's validation of a client's constraint (``sampling_params_from_client``): within
the constraint budget, or refused with a sentence naming the field and the limit; a grammar
whose compile would overflow a default thread stack (a segfault of the router) is validated
on the compile threads."""

from __future__ import annotations

import pytest

from services.common.convert import sampling_params_from_client
from splitserve.v1 import router_pb2, worker_pb2


def client_params(constraint: worker_pb2.OutputConstraint) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(max_tokens=8, constraint=constraint)


def test_a_huge_choice_list_is_refused_by_its_size_naming_the_limit():
    choices = worker_pb2.ChoiceList(choices=[f"choice number {i}" for i in range(100_000)])
    with pytest.raises(ValueError) as refused:
        sampling_params_from_client(client_params(worker_pb2.OutputConstraint(choice=choices)))
    assert str(refused.value) == "constraint.choice: 100000 choices, more than 10000"


def test_a_grammar_over_the_size_budget_is_refused_naming_the_limit():
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(20_000))
    with pytest.raises(ValueError) as refused:
        sampling_params_from_client(client_params(worker_pb2.OutputConstraint(grammar=grammar)))
    assert str(refused.value) == f"constraint.grammar: {len(grammar)} bytes, more than 65536"


def test_a_deep_chain_of_rules_is_validated_without_crashing_the_router():
    rules = "".join(f"r{i}: r{i + 1}\n" for i in range(5000))
    chain = f'start: r0\n{rules}r5000: "end"\n'
    params = sampling_params_from_client(client_params(worker_pb2.OutputConstraint(grammar=chain)))
    assert params.constraint is not None and params.constraint.spec == chain
