"""``MovingAverage``: what an engine measures of its own costs, for the router to price them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MovingAverage:
    """An exponentially weighted moving average: each sample moves ``value`` by ``weight`` of
    the difference; the first sample sets it. ``value`` is 0.0 until then."""

    weight: float = 0.1
    value: float = 0.0
    num_samples: int = 0

    def add(self, sample: float) -> None:
        self.value = (
            sample if not self.num_samples else self.value + self.weight * (sample - self.value)
        )
        self.num_samples += 1
