"""``engine.grammar_pool``: constraints compile on the pool's threads, once per constraint (a
repeated one is a cache hit, a repeated bad one fails from the cache), within the budget: over
the size budget is refused before any compile; past the time budget is refused while a running
compile runs on and its result serves the next request, and a compile still queued is dropped;
a caller on an event loop keeps it running while it waits; a chain of rules deep enough to
overflow a default thread stack (a segfault) compiles."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.constraint import Constraint, ConstraintKind, ConstraintLimits
from engine.grammar_pool import NUM_COMPILE_THREADS, GrammarPool
from tests.waiting import wait_until

WORDS = Constraint(ConstraintKind.REGEX, "[a-z]+( [a-z]+)*")
# A compile blocked on a test's gate gives up after this, so that a failed test cannot hold
# the process's compile threads.
GATE_TIMEOUT_S = 60.0


class Validations:
    """``Constraint.validate`` as a pool's compile, counting its calls; with a ``gate``, each
    call first waits for it to open."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.calls: list[Constraint] = []

    def __call__(self, constraint: Constraint) -> None:
        self.calls.append(constraint)
        if self.gate is not None:
            self.gate.wait(GATE_TIMEOUT_S)
        constraint.validate()


def test_a_repeated_constraint_compiles_once_and_a_bad_one_fails_from_the_cache():
    validations = Validations()
    pool = GrammarPool(validations, ConstraintLimits())
    pool.result(WORDS)
    pool.result(Constraint(ConstraintKind.REGEX, WORDS.spec))  # equal: the same grammar
    assert validations.calls == [WORDS]
    assert (pool.num_hits, pool.num_misses) == (1, 1)
    bad = Constraint(ConstraintKind.REGEX, "[a-z")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^regex: "):
            pool.result(bad)
    assert validations.calls == [WORDS, bad]


def test_a_constraint_over_the_size_budget_is_refused_before_any_compile():
    validations = Validations()
    pool = GrammarPool(validations, ConstraintLimits(max_choices=100))
    many = Constraint(ConstraintKind.CHOICE, choices=tuple(str(i) for i in range(101)))
    with pytest.raises(ValueError, match=r"^choice: 101 choices, more than 100$"):
        pool.submit(many)
    assert not validations.calls and pool.num_misses == 0


def test_a_compile_past_its_time_budget_is_refused_and_its_result_serves_the_next():
    gate = threading.Event()
    pool = GrammarPool(Validations(gate), ConstraintLimits(compile_timeout_s=0.1))
    try:
        with pytest.raises(ValueError, match=r"^regex: not compiled within 0.1 s"):
            pool.result(WORDS)
    finally:
        gate.set()
    pool.submit(WORDS).result(timeout=GATE_TIMEOUT_S)  # the compile ran on to its end
    pool.result(WORDS)
    assert pool.num_misses == 1


def test_a_compile_still_queued_when_its_waiter_gives_up_is_dropped():
    gate = threading.Event()
    validations = Validations(gate)
    pool = GrammarPool(validations, ConstraintLimits(compile_timeout_s=0.1))
    running = [Constraint(ConstraintKind.REGEX, f"[a-z]{{{n + 1}}}") for n in range(2)]
    queued = Constraint(ConstraintKind.REGEX, "[0-9]+")
    assert len(running) == NUM_COMPILE_THREADS
    try:
        for constraint in running:
            pool.submit(constraint)
        wait_until(lambda: len(validations.calls) == 2, GATE_TIMEOUT_S, "both threads busy")
        with pytest.raises(ValueError, match=r"^regex: not compiled within 0.1 s"):
            pool.result(queued)
    finally:
        gate.set()
    pool.submit(queued).result(timeout=GATE_TIMEOUT_S)  # queued anew, compiled once
    assert validations.calls.count(queued) == 1 and pool.num_misses == 4


def test_waiting_for_a_compile_leaves_the_event_loop_running():
    gate = threading.Event()
    pool = GrammarPool(Validations(gate), ConstraintLimits())

    async def main() -> int:
        waiting = asyncio.create_task(pool.wait(WORDS))
        turns = 0
        try:
            while turns < 100:  # the loop goes on turning while the compile is held
                await asyncio.sleep(0)
                turns += 1
            assert not waiting.done()
        finally:
            gate.set()
        await waiting
        return turns

    assert asyncio.run(main()) == 100


def test_a_chain_of_rules_deeper_than_a_default_stack_holds_compiles():
    # llguidance recurses once per rule: 5,000 (60 KiB, within the size budget) overflowed an
    # 8 MiB stack, which kills the process; the pool's threads have deep stacks.
    rules = "".join(f"r{i}: r{i + 1}\n" for i in range(5000))
    chain = Constraint(ConstraintKind.GRAMMAR, f'start: r0\n{rules}r5000: "end"\n')
    assert chain.num_bytes < ConstraintLimits().max_bytes
    GrammarPool(Constraint.validate, ConstraintLimits()).result(chain)
