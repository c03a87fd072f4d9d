"""One request's latency and token accounting as its messages leave the router.

Every message updates, at once, the router's ``splitserve_router_*`` histograms, the standard
(vLLM-named) metrics of the ``router`` pool (``serving_metrics``), the autoscaler's latency
window and the numbers of the request's log line (``RequestLog``), so that they never disagree:
TTFT is from receiving the request to sending the first token, ITL the gap between two
messages spread over their tokens, E2E until the last message.
"""

from __future__ import annotations

import time

from services.common.serving_metrics import ServingMetrics
from services.router import metrics
from services.router.latency import LatencyWindow
from services.router.request_log import Outcome, RequestLog
from splitserve.v1 import router_pb2


class RequestMeter:
    """Fed each message the client is sent (``sent``), then the finish (``finished``)."""

    def __init__(
        self, start_s: float, log: RequestLog, serving: ServingMetrics, latency: LatencyWindow
    ) -> None:
        self._start_s = start_s
        self._log = log
        self._serving = serving
        self._latency = latency
        self._last_token_s: float | None = None

    def sent(self, message: router_pb2.GenerateResponse) -> None:
        """``message`` left for the client (its ``time.perf_counter()`` is now)."""
        num_tokens = len(message.token_ids)
        metrics.GENERATION_TOKENS.inc(num_tokens)
        if not num_tokens:
            return
        now_s = time.perf_counter()
        self._log.output_tokens += num_tokens
        if self._last_token_s is None:
            ttft_s = now_s - self._start_s
            self._log.ttft_ms = ttft_s * 1000
            metrics.TTFT.observe(ttft_s)
            self._serving.ttft.observe(ttft_s)
            self._serving.tokens_streamed(num_tokens, None)
            self._latency.add_ttft(ttft_s)
        else:
            gap_s = now_s - self._last_token_s
            for _ in range(num_tokens):
                metrics.ITL.observe(gap_s / num_tokens)
            self._serving.tokens_streamed(num_tokens, gap_s)
            self._latency.add_itl(gap_s, num_tokens)
        self._last_token_s = now_s

    def finished(self, last: router_pb2.GenerateResponse, outcome: Outcome) -> None:
        """The request ended with ``outcome`` (``stop``, ``length``, ...); ``last`` is its last
        message (with the usage)."""
        log = self._log
        e2e_s = time.perf_counter() - self._start_s
        log.e2e_ms = e2e_s * 1000
        log.cached_tokens = last.usage.cached_tokens
        metrics.E2E.observe(e2e_s)
        metrics.PROMPT_TOKENS.inc(log.prompt_tokens)
        serving = self._serving
        serving.finished(outcome.value, log.prompt_tokens, log.output_tokens)
        serving.e2e.observe(e2e_s)
        if log.ttft_ms is not None:
            decode_s = e2e_s - log.ttft_ms / 1000
            serving.decode_time.observe(decode_s)
            if log.output_tokens > 1:
                serving.tpot.observe(decode_s / (log.output_tokens - 1))
