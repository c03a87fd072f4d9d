"""Constrained requests held out of the scheduler while their grammar compiles.

A request whose constraint's grammar is compiled already (a cached compile) gets its matcher
and is scheduled at once; any other waits here while ``grammars`` compiles it on threads of its
own, and joins the scheduler at the first step after the compile is done. A compile that fails
or outlives ``ConstraintLimits.compile_timeout_s`` fails its request instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.constraint import Constraint, ConstraintLimits
from engine.grammar_pool import GrammarPool
from engine.request import Request
from engine.structured_output import CompiledGrammar, GrammarCompiler
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Held:
    request: Request
    constraint: Constraint
    grammar: concurrent.futures.Future[CompiledGrammar]
    deadline_s: float  # time.monotonic(): past it, the request fails


class GrammarAdmission:
    """The constrained requests of one engine whose grammar is still compiling, in the order
    they were added.

    Engine thread only, except ``grammars`` (thread-safe) and ``on_compiled``, which is called
    on a compile thread when a held request's compile is done or failed.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: ConstraintLimits) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.grammars: GrammarPool[CompiledGrammar] = GrammarPool(self._compile, limits)
        self.on_compiled: Callable[[], object] | None = None
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held

    def start(self, request: Request) -> bool:
        """Whether ``request`` may be scheduled now: it has no constraint, or its grammar is
        compiled (its matcher is then set, advanced over its output tokens). Otherwise it is
        held here and False is returned. ``ValueError`` if its constraint is over its size
        budget, or (compiled already) does not compile or its output tokens break it."""
        constraint = request.sampling_params.constraint
        if constraint is None:
            return True
        grammar = self.grammars.submit(constraint)
        if grammar.done():
            compiled = self.grammars.outcome(constraint, grammar)
            request.matcher = compiled.matcher(request.output_token_ids)
            return True
        deadline_s = time.monotonic() + self.grammars.limits.compile_timeout_s
        self._held[request.req_id] = _Held(request, constraint, grammar, deadline_s)
        grammar.add_done_callback(self._notify)
        return False

    def admit(self) -> tuple[list[Request], list[Request]]:
        """The held requests whose compile is over, in the order they were added: those ready
        to schedule (matcher set), and those failed (``request.error`` says why: it did not
        compile, in time or at all, or their output tokens break it). Neither is held after."""
        ready: list[Request] = []
        failed: list[Request] = []
        now_s = time.monotonic()
        for req_id, held in list(self._held.items()):
            grammar = held.grammar
            if not grammar.done() and now_s < held.deadline_s:
                continue
            del self._held[req_id]
            request = held.request
            try:
                if not grammar.done():
                    raise self.grammars.give_up(held.constraint, grammar)
                compiled = self.grammars.outcome(held.constraint, grammar)
                request.matcher = compiled.matcher(request.output_token_ids)
            except ValueError as exc:
                request.error = f"constraint: {exc}"
                logger.warning("req_id=%s failed: %s", req_id, request.error)
                failed.append(request)
                continue
            ready.append(request)
        return ready, failed

    def discard(self, req_id: str) -> Request | None:
        """Stop holding ``req_id``; its request, or None if it was not held."""
        held = self._held.pop(req_id, None)
        return None if held is None else held.request

    def wait(self) -> None:
        """Block until a held request's compile is done or the earliest compile budget runs
        out; return at once when no request is held."""
        if not self._held:
            return
        deadline_s = min(held.deadline_s for held in self._held.values())
        concurrent.futures.wait(
            [held.grammar for held in self._held.values()],
            timeout=max(deadline_s - time.monotonic(), 0.0),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        """``grammars``' compile, on a compile thread. The compiler is built by the first one
        (it converts the whole vocabulary once, about a second)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._tokenizer.backend.to_str(),
                    self._vocab_size,
                    self._tokenizer.eos_token_ids,
                )
        return self._compiler.compile(constraint)

    def _notify(self, _: concurrent.futures.Future[CompiledGrammar]) -> None:
        if self.on_compiled is not None:
            self.on_compiled()
