"""The latencies clients saw since the last look: what an autoscaler judges pools by.

TTFT judges the prefill pool, inter-token latency (ITL) the decode pool. Only the newest
``max_samples`` of each are kept between two ``take`` calls, so an orchestrator that stops
asking costs a bounded amount of memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_MAX_SAMPLES = 20_000


@dataclass(frozen=True, slots=True)
class LatencySamples:
    """Samples in seconds, in arrival order."""

    ttft_s: list[float]
    itl_s: list[float]


class LatencyWindow:
    """TTFT and ITL samples since the last ``take``."""

    def __init__(self, max_samples: int = _MAX_SAMPLES) -> None:
        self._ttft_s: deque[float] = deque(maxlen=max_samples)
        self._itl_s: deque[float] = deque(maxlen=max_samples)

    def add_ttft(self, seconds: float) -> None:
        self._ttft_s.append(seconds)

    def add_itl(self, gap_s: float, num_tokens: int) -> None:
        """A message of ``num_tokens`` tokens ``gap_s`` after the previous one: each token
        counts as one sample of ``gap_s / num_tokens``."""
        per_token_s = gap_s / num_tokens
        self._itl_s.extend(per_token_s for _ in range(num_tokens))

    def take(self) -> LatencySamples:
        """Everything since the last call; empties the window."""
        samples = LatencySamples(list(self._ttft_s), list(self._itl_s))
        self._ttft_s.clear()
        self._itl_s.clear()
        return samples
