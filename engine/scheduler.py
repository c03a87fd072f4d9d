"""Continuous-batching scheduler with no prefill/decode phases.

Each step every request catches ``num_computed_tokens`` up towards ``num_tokens`` under a token
budget: a long prompt is cut into chunks (chunked prefill), prefix hits skip computed blocks, and
prompt chunks share a step with single-token decodes. When the pool runs dry the newest running
request is preempted and later recomputed from scratch (its cached blocks usually still hit).

The waiting queue runs front to back, no request overtaking one that does not fit::

    | preempted (newest victim first) | remote KV arrived (FIFO) | new (FIFO) |

Under ``priority`` (vLLM's ``--scheduling-policy priority``) the queue is ordered by (priority,
arrival) instead, lower first, and the victim of a preemption is the running request of the
lowest priority (the newest among them). Before a step is scheduled, the first waiting request
preempts running requests of strictly lower priority while it would find no ``max_num_seqs``
slot or too few free blocks for its tokens: a high-priority request waits for no low-priority
one to finish. A step admits no request of lower priority than one it admitted, so that a
high-priority prompt is not slowed by lower-priority ones batched with it.

A paused request (its reader fell behind, ``set_paused``) makes no progress, so it gives way:
it gets no tokens, is the first victim when blocks run out, is preempted when a waiting
request lacks a ``max_num_seqs`` slot or blocks, and is skipped by admission (keeping its
place, not blocking the requests behind it) until it is resumed.

With a ``proposer`` a greedy decode also carries draft tokens (``engine.ngram_proposer``): the
step computes its last token and the drafts together, and ``update_from_output`` keeps the
drafts that match the samples, plus the sample after the last match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.ngram_proposer import NgramProposer
from engine.request import Request, RequestStatus
from engine.scheduler_output import KVLoad, ScheduledRequest, SchedulerOutput


class DuplicateRequestError(ValueError):
    """A request id that is live or holds KV (under a lease) on this engine was added again."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Most prompt tokens per request per step (0: no cap below the step budget).
    long_prefill_token_threshold: int = 0
    # Order by each request's priority (see the module) instead of arrival.
    by_priority: bool = False

    @property
    def max_chunk_tokens(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens


class Scheduler:
    """Owns the waiting queue, the running batch and the KV cache manager of one engine."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        proposer: NgramProposer | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.proposer = proposer
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote_kv: dict[str, Request] = {}
        # Finished requests whose blocks stay allocated until ``release_held_kv`` (hold_kv).
        self.held_kv: dict[str, Request] = {}
        # Requests whose reader fell behind: no tokens, first to give way (see the module).
        self.paused: set[str] = set()
        self.num_preemptions = 0
        # Speculation counters (vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue ``request``; ``DuplicateRequestError`` if its id is live or holds KV here (its
        blocks are keyed by id: a second owner would write into them)."""
        if request.req_id in self.requests:
            raise DuplicateRequestError(f"request_id {request.req_id!r} is already in flight")
        if request.req_id in self.held_kv:
            raise DuplicateRequestError(
                f"request_id {request.req_id!r} still holds its KV cache under a lease"
            )
        if not 0 <= request.num_external_tokens < request.num_tokens:
            raise ValueError("num_external_tokens must leave at least one token to compute")
        self.requests[request.req_id] = request
        if self.config.by_priority:
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort, stop string) requests in any state and free their blocks.

        Unknown or already finished ids are ignored. Returns the requests finished here.
        """
        finished: list[Request] = []
        for req_id in req_ids:
            request = self.requests.pop(req_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.waiting_for_remote_kv[req_id]
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def set_paused(self, req_id: str, paused: bool) -> None:
        """Stop (or resume) scheduling ``req_id``: while paused it keeps the blocks it has until
        they are needed and is not admitted again once preempted (see the module). Unknown
        ids are ignored."""
        if paused and req_id in self.requests:
            self.paused.add(req_id)
        else:
            self.paused.discard(req_id)

    def finish_remote_kv(self, req_id: str, success: bool) -> None:
        """A transfer announced in ``SchedulerOutput.kv_loads`` completed (or failed).

        On success the external tokens count as computed and their blocks become prefix-cache
        hits; on failure they are recomputed locally. Either way the request waits to run,
        behind the preempted requests and the earlier arrivals of remote KV, ahead of new ones.
        """
        request = self.waiting_for_remote_kv.pop(req_id, None)
        if request is None:
            return
        if success:
            request.num_computed_tokens = request.num_external_tokens
            self.kv_cache_manager.cache_blocks(request, request.num_external_tokens)
        request.num_cached_tokens = request.num_computed_tokens
        request.num_external_tokens = 0
        request.status = RequestStatus.WAITING
        if self.config.by_priority:
            self._insert_by_priority(request)
            return
        # New requests are the only waiting ones never given blocks (``scheduled_time_s``).
        index = 0
        while index < len(self.waiting) and self.waiting[index].scheduled_time_s is not None:
            index += 1
        self.waiting.insert(index, request)

    def _insert_by_priority(self, request: Request) -> None:
        """Into ``waiting`` after every request that goes first (``_rank``)."""
        rank = _rank(request)
        index = len(self.waiting)
        while index > 0 and _rank(self.waiting[index - 1]) > rank:
            index -= 1
        self.waiting.insert(index, request)

    def pin_cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """Hold the longest run (at most ``max_blocks``) of ``request``'s full blocks held here,
        as a finished ``hold_kv`` request would (until ``release_held_kv``), without scheduling
        it: what a peer pulls a prefix from. The run continues from the cache into the second
        tier: those blocks are loaded into free ones and published, as a prefix hit loads them.
        Returns their ids ([]: none held, and nothing is held then). ``DuplicateRequestError``
        if the id is live or holds KV here."""
        if request.req_id in self.requests or request.req_id in self.held_kv:
            raise DuplicateRequestError(f"request_id {request.req_id!r} is in use here")
        manager = self.kv_cache_manager
        hits = manager.get_computed_blocks(request)[:max_blocks]
        num_tier_blocks = min(
            manager.num_offloaded_hits(request, len(hits)), max_blocks - len(hits)
        )
        if not hits and not num_tier_blocks:
            return []
        num_tier_tokens = num_tier_blocks * self.block_size
        if not manager.allocate_slots(request, num_tier_tokens, hits, cache=False):
            return []
        num_blocks = len(hits)
        if num_tier_blocks:
            num_blocks += manager.load_offloaded(request, len(hits), num_tier_blocks)
            manager.cache_blocks(request, num_blocks * self.block_size)
        if not num_blocks:  # the tier's blocks went (or were refused) since it counted them
            manager.free(request)
            return []
        self.held_kv[request.req_id] = request
        # A short load leaves blocks past the run unfilled: held, never published, never read.
        return manager.get_block_ids(request.req_id)[:num_blocks]

    def release_held_kv(self, req_id: str) -> bool:
        """Free the blocks a finished ``hold_kv`` request kept; False if it holds none."""
        request = self.held_kv.pop(req_id, None)
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        return True

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting but not computed yet: without remote KV, and for
        requests not admitted yet, without the prefix-cache hits they would get now."""
        total = 0
        for request in (*self.waiting, *self.running):
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining <= 1:
                continue
            skipped = request.num_external_tokens
            if request.num_computed_tokens == 0:
                hits = len(self.kv_cache_manager.get_computed_blocks(request))
                hits += self.kv_cache_manager.num_offloaded_hits(request, hits)
                skipped = max(skipped, hits * self.block_size)
            total += max(remaining - skipped, 0)
        return total

    # ----------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Side effects: allocates blocks, may preempt, admits requests."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        if self.config.by_priority:
            self._make_room_by_priority(out)
        # Admission waits a step after a preemption for room, not after one made for it.
        num_preempted_for_room = len(out.preempted_req_ids)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.req_id in self.paused:
                i += 1
                continue
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                self.config.max_chunk_tokens,
            )
            draft = self._draft(request, budget - num_new) if num_new == 1 else []
            if draft and not self.kv_cache_manager.allocate_slots(request, num_new + len(draft)):
                draft = []
            while not draft and not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self._newest_paused_running()
                if victim is None:
                    victim = self._last_to_run()
                self._preempt_running(victim, out)
                if victim == i:
                    break
                if victim < i:
                    i -= 1
            else:
                item = self._scheduled(request, num_new + len(draft), tuple(draft))
                (decodes if item.is_decode else prefills).append(item)
                budget -= item.num_new_tokens
                i += 1

        if len(out.preempted_req_ids) == num_preempted_for_room:
            admitted = self._admit_waiting(budget, out)
            for item in admitted:
                (decodes if item.is_decode else prefills).append(item)
        out.scheduled = decodes + prefills
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Admit waiting requests in queue order while the budget, ``max_num_seqs`` slots and
        blocks last, skipping paused ones; one that lacks a slot or blocks preempts the newest
        paused running request, else stops admission."""
        admitted: list[ScheduledRequest] = []
        index = 0
        while index < len(self.waiting) and budget > 0:
            request = self.waiting[index]
            if request.req_id in self.paused:
                index += 1
                continue
            if (
                self.config.by_priority
                and admitted
                and (request.priority > admitted[0].request.priority)
            ):
                break  # a higher priority's prompt does not share its step with a lower one's
            hits = []
            fresh = not self.kv_cache_manager.has_blocks(request.req_id)
            if fresh:
                hits = self.kv_cache_manager.get_computed_blocks(request)
            remote = request.num_external_tokens > 0
            num_hit_tokens = len(hits) * self.block_size
            # Blocks of the prefix past ``hits`` that the second tier holds: loaded, not computed.
            num_tier_blocks = 0
            if remote:
                num_hit_tokens = min(num_hit_tokens, request.num_external_tokens)
                num_new = request.num_external_tokens - num_hit_tokens
            else:
                if fresh:
                    num_tier_blocks = self.kv_cache_manager.num_offloaded_hits(request, len(hits))
                num_new = min(
                    request.num_tokens
                    - request.num_computed_tokens
                    - num_hit_tokens
                    - num_tier_blocks * self.block_size,
                    budget,
                    self.config.max_chunk_tokens,
                )
            num_tier_tokens = num_tier_blocks * self.block_size
            if len(self.running) >= self.config.max_num_seqs or not (
                self.kv_cache_manager.allocate_slots(
                    request,
                    num_tier_tokens + num_new,
                    hits,
                    cache=not remote and not num_tier_blocks,
                )
            ):
                victim = self._newest_paused_running()
                if victim is not None:
                    self._preempt_running(victim, out)
                    index += 1  # the victim went to the front of the queue
                    continue
                if not self.running and self._free_newest_waiting_holder(request, out):
                    continue  # again, with the blocks it freed
                break
            del self.waiting[index]
            request.mark_scheduled()
            if remote:
                self._wait_for_remote_kv(request, num_hit_tokens, out.kv_loads)
                continue
            num_loaded_tokens = 0
            if num_tier_blocks:
                num_loaded_tokens = self._load_offloaded(
                    request, len(hits), num_tier_blocks, num_new
                )
                num_hit_tokens += num_loaded_tokens
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
                request.num_tier_tokens = num_loaded_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(self._scheduled(request, num_new))
            budget -= num_new
        return admitted

    def _load_offloaded(
        self, request: Request, first_block: int, num_blocks: int, num_new: int
    ) -> int:
        """Fill the blocks allocated for the tier's part of the prefix; publish them and the
        ones this step computes. Returns the tokens loaded: on a short load the step computes
        its ``num_new`` tokens from the first block not loaded instead."""
        num_loaded = self.kv_cache_manager.load_offloaded(request, first_block, num_blocks)
        num_loaded_tokens = num_loaded * self.block_size
        num_hit_tokens = first_block * self.block_size
        self.kv_cache_manager.cache_blocks(request, num_hit_tokens + num_loaded_tokens + num_new)
        return num_loaded_tokens

    def _wait_for_remote_kv(
        self, request: Request, num_hit_tokens: int, kv_loads: list[KVLoad]
    ) -> None:
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[request.req_id] = request
        kv_loads.append(
            KVLoad(
                req_id=request.req_id,
                block_ids=self.kv_cache_manager.get_block_ids(request.req_id),
                num_local_hit_tokens=num_hit_tokens,
                num_external_tokens=request.num_external_tokens,
            )
        )

    def _scheduled(
        self, request: Request, num_new_tokens: int, spec_token_ids: tuple[int, ...] = ()
    ) -> ScheduledRequest:
        block_ids = self.kv_cache_manager.block_ids_view(request.req_id)
        return ScheduledRequest(request, num_new_tokens, block_ids, spec_token_ids)

    def _draft(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decode of ``request`` in this step ([] when it takes none): at
        most ``budget``, and few enough that accepting all of them plus the bonus token stays
        within ``max_tokens`` and ``max_model_len``."""
        if self.proposer is None or not request.sampling_params.accepts_drafts:
            return []
        max_tokens = min(
            budget,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(request, max_tokens)

    def _newest_paused_running(self) -> int | None:
        """The index in ``running`` of its newest paused request (None: none is paused)."""
        if self.paused:
            for index in range(len(self.running) - 1, -1, -1):
                if self.running[index].req_id in self.paused:
                    return index
        return None

    def _free_newest_waiting_holder(self, keep: Request, out: SchedulerOutput) -> bool:
        """Free the blocks of the newest waiting request that holds some (KV that arrived by
        transfer), other than ``keep``; it keeps its place in the queue and finds its prompt
        again as prefix hits, or computes it, once admitted. With nothing running, those blocks
        are the only ones that can come free: without this, requests whose KV arrived could
        each hold part of the cache and wait for more, forever. False: no other holds any."""
        for holder in reversed(self.waiting):
            if holder is not keep and self.kv_cache_manager.has_blocks(holder.req_id):
                self.kv_cache_manager.free(holder)
                holder.num_computed_tokens = 0
                holder.num_cached_tokens = -1
                holder.num_preemptions += 1
                self.num_preemptions += 1
                out.preempted_req_ids.append(holder.req_id)
                return True
        return False

    def _last_to_run(self) -> int:
        """The index in ``running`` of the request that gives way first: the newest, or under
        ``by_priority`` the newest of the lowest priority."""
        if not self.config.by_priority:
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda i: (*_rank(self.running[i]), i))

    def _make_room_by_priority(self, out: SchedulerOutput) -> None:
        """Preempt running requests of lower priority than the first waiting one while it
        would find no slot or too few free blocks (see the module)."""
        first = next((r for r in self.waiting if r.req_id not in self.paused), None)
        if first is None:
            return
        needed_blocks = -(-first.num_tokens // self.block_size)
        while self.running and (
            len(self.running) >= self.config.max_num_seqs
            or self.kv_cache_manager.block_pool.num_free_blocks < needed_blocks
        ):
            victim = self._last_to_run()
            if self.running[victim].priority <= first.priority:
                return
            self._preempt_running(victim, out)

    def _preempt_running(self, index: int, out: SchedulerOutput) -> None:
        """Preempt ``running[index]``: its blocks are freed and it goes back to the front of
        the waiting queue (victims taken newest first keep their admission order), or under
        ``by_priority`` to its place by rank."""
        request = self.running.pop(index)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.by_priority:
            self._insert_by_priority(request)
        else:
            self.waiting.appendleft(request)
        out.preempted_req_ids.append(request.req_id)

    # ----------------------------------------------------------------------------- update
    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: list[int]
    ) -> tuple[list[Request], list[Request]]:
        """Advance computed tokens and append sampled tokens (one per sampling request, in order).

        Returns (requests that got a new token, requests finished by eos / stop id / length).
        """
        updated: list[Request] = []
        finished: list[Request] = []
        samples = iter(sampled_token_ids)
        for item in output.scheduled:
            request = item.request
            num_rows = item.num_sample_rows
            spec = item.spec_token_ids
            request.num_computed_tokens += item.num_new_tokens - len(spec)
            if not num_rows:
                continue
            tokens = [next(samples) for _ in range(num_rows)]
            # A draft stands when the sample before it is that draft; its KV is then valid.
            num_accepted = 0
            while num_accepted < len(spec) and tokens[num_accepted] == spec[num_accepted]:
                num_accepted += 1
            request.num_computed_tokens += num_accepted
            self.num_draft_tokens += len(spec)
            self.num_accepted_tokens += num_accepted
            updated.append(request)
            for token_id in tokens[: num_accepted + 1]:
                request.append_output_token(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self.requests.pop(request.req_id)
                    self.running.remove(request)
                    self._finish(request, status)
                    finished.append(request)
                    break
        return updated, finished

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        matcher = request.matcher
        if matcher is not None:
            if not matcher.accept(token_id):  # the bitmask allowed it: a bug, this request's
                request.error = f"the output constraint refused token {token_id}: {matcher.error}"
                return RequestStatus.FINISHED_ERROR
            if matcher.is_finished:  # the constraint is complete (its grammar's end)
                return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.paused.discard(request.req_id)
        if self.proposer is not None:
            self.proposer.forget(request.req_id)
        if status is RequestStatus.FINISHED_ERROR:
            self.kv_cache_manager.free(request, uncache=True)
        elif request.hold_kv and status is not RequestStatus.FINISHED_ABORTED:
            self.held_kv[request.req_id] = request
        else:
            self.kv_cache_manager.free(request)


def _rank(request: Request) -> tuple[int, float]:
    """Which request runs first under ``by_priority``: lower priority value, then earlier."""
    return request.priority, request.arrival_time_s
