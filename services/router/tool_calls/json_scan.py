"""Where JSON objects end in text that arrives piece by piece.

A tool call's JSON is complete when its braces balance outside strings; finding that point
needs no parser, and scanning each new piece once keeps a long generation linear.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ObjectScanner:
    """Spans of the JSON objects that open at ``base_depth`` (0: top level; 1: the elements of
    an array), in text fed in order. ``scan`` returns the spans that closed in the new text,
    as (start, end) offsets into the whole text fed so far; ``value_end`` is the offset just
    past the bracket that closed the first top-level value (-1 until one has)."""

    base_depth: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _offset: int = 0
    _start: int = -1
    value_end: int = -1

    def scan(self, piece: str) -> list[tuple[int, int]]:
        spans = []
        for i, char in enumerate(piece, start=self._offset):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                if char == "{" and self._depth == self.base_depth:
                    self._start = i
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if char == "}" and self._depth == self.base_depth and self._start >= 0:
                    spans.append((self._start, i + 1))
                    self._start = -1
                if self._depth == 0 and self.value_end < 0:
                    self.value_end = i + 1
        self._offset += len(piece)
        return spans
