"""The router's validation of a client's constraint (``validate_client_constraint``): within
the constraint budget, or refused with a sentence naming the field and the limit; a grammar
whose compile would overflow a default thread stack (a segfault of the router) is validated
on the compile threads, and the event loop runs on while a constraint is checked."""

from __future__ import annotations

import asyncio

import pytest

from engine.constraint import Constraint
from services.common.convert import sampling_params_from_client, validate_client_constraint
from splitserve.v1 import router_pb2, worker_pb2


def client_constraint(constraint: worker_pb2.OutputConstraint) -> Constraint:
    params = sampling_params_from_client(
        router_pb2.SamplingParams(max_tokens=8, constraint=constraint)
    )
    assert params.constraint is not None
    return params.constraint


def validate(constraint: Constraint) -> None:
    asyncio.run(validate_client_constraint(constraint))


def test_a_huge_choice_list_is_refused_by_its_size_naming_the_limit():
    choices = worker_pb2.ChoiceList(choices=[f"choice number {i}" for i in range(100_000)])
    with pytest.raises(ValueError) as refused:
        validate(client_constraint(worker_pb2.OutputConstraint(choice=choices)))
    assert str(refused.value) == "constraint.choice: 100000 choices, more than 10000"


def test_a_grammar_over_the_size_budget_is_refused_naming_the_limit():
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(20_000))
    with pytest.raises(ValueError) as refused:
        validate(client_constraint(worker_pb2.OutputConstraint(grammar=grammar)))
    assert str(refused.value) == f"constraint.grammar: {len(grammar)} bytes, more than 65536"


def test_a_grammar_that_does_not_compile_is_refused_naming_its_kind():
    with pytest.raises(ValueError, match=r"^constraint\.grammar: "):
        validate(client_constraint(worker_pb2.OutputConstraint(grammar="start: undefined_rule")))


def test_a_deep_chain_of_rules_is_validated_without_crashing_the_router():
    rules = "".join(f"r{i}: r{i + 1}\n" for i in range(5000))
    chain = f'start: r0\n{rules}r5000: "end"\n'
    constraint = client_constraint(worker_pb2.OutputConstraint(grammar=chain))
    validate(constraint)
    assert constraint.spec == chain


def test_the_event_loop_runs_on_while_a_constraint_is_checked():
    # A fresh schema (not cached): its check runs on the validation threads.
    properties = ", ".join(f'"p{i}": {{"type": "integer"}}' for i in range(400))
    schema = f'{{"type": "object", "properties": {{{properties}}}}}'
    constraint = client_constraint(worker_pb2.OutputConstraint(json_schema=schema))

    async def run() -> int:
        ticks = 0
        check = asyncio.create_task(validate_client_constraint(constraint))
        while not check.done():
            ticks += 1
            await asyncio.sleep(0)
        await check
        return ticks

    assert asyncio.run(run()) > 1
