"""``LogprobColumns``: logprob entries as flat arrays, for responses held until they end."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

from splitserve.v1 import worker_pb2

# One logprob entry: its token id, its logprob, and its top alternatives' (id, logprob).
LogprobEntry = tuple[int, float, Iterable[tuple[int, float]]]


class LogprobColumns:
    """One choice's logprob entries as flat arrays: ids as int32 and logprobs as float32 (the
    worker's own types, so every value reads back as it came)."""

    __slots__ = ("logprobs", "ranks", "token_ids", "top_ends", "top_ids", "top_logprobs")

    def __init__(self) -> None:
        self.token_ids = array("i")
        self.logprobs = array("f")
        self.ranks = array("i")
        # Entry i's top alternatives are top_*[top_ends[i - 1]:top_ends[i]].
        self.top_ends = array("I")
        self.top_ids = array("i")
        self.top_logprobs = array("f")

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, entries: Iterable[worker_pb2.TokenLogprob]) -> None:
        for entry in entries:
            self.token_ids.append(entry.token_id)
            self.logprobs.append(entry.logprob)
            self.ranks.append(entry.rank)
            for top in entry.top:
                self.top_ids.append(top.token_id)
                self.top_logprobs.append(top.logprob)
            self.top_ends.append(len(self.top_ids))

    def entries(self, start: int, stop: int) -> Iterator[LogprobEntry]:
        """Entries ``start`` to ``stop`` (exclusive)."""
        top_start = self.top_ends[start - 1] if start else 0
        for i in range(start, min(stop, len(self))):
            top_stop = self.top_ends[i]
            tops = zip(
                self.top_ids[top_start:top_stop],
                self.top_logprobs[top_start:top_stop],
                strict=True,
            )
            yield self.token_ids[i], self.logprobs[i], tops
            top_start = top_stop
