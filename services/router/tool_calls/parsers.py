"""The model's tool calls, parsed out of its text as it streams.

A parser takes a generation's text piece by piece (``feed``) and hands back what the client
sees: the content and the calls (``ToolCallDelta``s). What it cannot place yet (a piece that may
be the start of a call marker, a call whose JSON is not complete) it holds. ``finish`` hands
back the rest. The same parser makes the whole response (one ``feed`` of all the text) and the
stream, so a stream's pieces always concatenate to the whole response's content and calls.

With ``tool_choice: auto`` the model writes calls in its own format (``ToolCallFormat``, as
vLLM's ``--tool-call-parser``); text that looks like a call but does not parse is content. With
``required`` or a named function, a grammar shaped the text (``tool_use``), so it parses.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.router.tool_calls.json_scan import ObjectScanner
from splitserve.v1 import router_pb2


class ToolCallFormat(enum.StrEnum):
    """How a model family writes its calls with ``tool_choice: auto`` (``--tool-call-parser``)."""

    # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call (or a list in one):
    # Qwen2.5 / Qwen3, Hermes 2 / 3, SmolLM2, and any template without tools of its own.
    HERMES = "hermes"
    # The whole turn is {"name": ..., "parameters": {...}} objects, ';'-separated, after an
    # optional <|python_tag|>: Llama 3.1 to 3.3's JSON tool calling.
    LLAMA3_JSON = "llama3_json"
    # [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]: Mistral's v3 template.
    MISTRAL = "mistral"


FORMATS = tuple(f.value for f in ToolCallFormat)


@dataclass(slots=True)
class ParsedDelta:
    """What a piece of text adds to the response: content and call pieces."""

    content: str = ""
    calls: list[router_pb2.ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolCallParser(Protocol):
    """One generation's parser (see the module's docstring). Not thread-safe."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    @property
    def num_calls(self) -> int: ...


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_of(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object (arguments under ``arguments`` or
    ``parameters``, an object or JSON text of one); None when it is not a call."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _calls_in(text: str) -> list[tuple[str, str]] | None:
    """The calls of a JSON object or list of objects; None unless every one is a call."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_of(v) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _held_prefix_len(text: str, marker: str) -> int:
    """The length of ``text``'s longest suffix that begins ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class _Calls:
    """Numbers the calls and gives each an id; with ``parallel`` false, only the first counts."""

    def __init__(self, parallel: bool) -> None:
        self.num_calls = 0
        self._limit = None if parallel else 1

    def emit(self, out: ParsedDelta, calls: list[tuple[str, str]]) -> None:
        for name, arguments in calls:
            if self._limit is not None and self.num_calls >= self._limit:
                return
            out.calls.append(
                router_pb2.ToolCallDelta(
                    index=self.num_calls, id=new_call_id(), name=name, arguments=arguments
                )
            )
            self.num_calls += 1


class _ContentAndCalls:
    """Content, then calls: content before the first call streams as it comes (whitespace
    alone waits: the template's line break before a call is not content); what is not a call
    after it is held to the end and kept only if it is more than whitespace."""

    def __init__(self, parallel: bool) -> None:
        self._calls = _Calls(parallel)
        self._blank = ""  # whitespace not yet known to be content
        self._streamed = False  # some content was handed back
        self._held = ""

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    def _content(self, out: ParsedDelta, text: str) -> None:
        if self._calls.num_calls or self._held:
            self._held += text
        elif self._streamed or text.strip():
            out.content += self._blank + text
            self._blank = ""
            self._streamed = True
        else:
            self._blank += text

    def _emit(self, out: ParsedDelta, calls: list[tuple[str, str]]) -> None:
        self._calls.emit(out, calls)
        self._blank = ""

    def _finish_held(self, out: ParsedDelta) -> None:
        if self._held.strip():
            out.content += self._held
        if not self._calls.num_calls:
            out.content += self._blank
        self._held = self._blank = ""


class _MarkedParser(_ContentAndCalls):
    """Calls that begin with a marker (Hermes' ``<tool_call>``, Mistral's ``[TOOL_CALLS]``);
    ``_body_end`` finds where a call's body ends in the text after its marker."""

    start_marker = ""

    def __init__(self, parallel: bool) -> None:
        super().__init__(parallel)
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        while True:
            if not self._in_call:
                start = self._buffer.find(self.start_marker)
                if start < 0:
                    keep = _held_prefix_len(self._buffer, self.start_marker)
                    self._content(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                self._content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(self.start_marker) :]
                self._in_call = True
                self._start_body()
            ends = self._body_end(self._buffer)
            if ends is None:
                return out
            body_end, resume = ends
            self._end_call(out, self._buffer[:body_end], self._buffer[body_end:resume])
            self._buffer = self._buffer[resume:]

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:
            self._end_call(out, *self._cut_off_body(self._buffer))
        else:
            self._content(out, self._buffer)
        self._buffer = ""
        self._finish_held(out)
        return out

    def _end_call(self, out: ParsedDelta, body: str, terminator: str) -> None:
        self._in_call = False
        calls = self._parse_body(body)
        if calls is None:
            self._content(out, self.start_marker + body + terminator)
        else:
            self._emit(out, calls)

    def _parse_body(self, body: str) -> list[tuple[str, str]] | None:
        """The calls of a whole body; None when it holds none (it is then content)."""
        return _calls_in(body)

    def _start_body(self) -> None:
        """A new call's body begins."""

    def _body_end(self, text: str) -> tuple[int, int] | None:
        """(end of the body, end of its terminator) in ``text``; None while it goes on."""
        raise NotImplementedError

    def _cut_off_body(self, text: str) -> tuple[str, str]:
        """(body, the start of its terminator) of a call the generation ended in."""
        return text, ""


class HermesParser(_MarkedParser):
    """``<tool_call>`` JSON ``</tool_call>``; a call cut off before its end tag still counts
    when its JSON is whole."""

    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _body_end(self, text: str) -> tuple[int, int] | None:
        end = text.find(self.end_marker)
        return None if end < 0 else (end, end + len(self.end_marker))

    def _cut_off_body(self, text: str) -> tuple[str, str]:
        keep = _held_prefix_len(text, self.end_marker)
        return text[: len(text) - keep], text[len(text) - keep :]


class MistralParser(_MarkedParser):
    """``[TOOL_CALLS]`` then one JSON array (or object) of calls (the v3 to v7 tokenizers'
    form), or a function name, ``[ARGS]`` and its arguments' JSON object (v11 on: one call per
    ``[TOOL_CALLS]``)."""

    start_marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def _start_body(self) -> None:
        self._scanner = ObjectScanner()
        self._named: bool | None = None  # the v11 form; None until the body shows which
        # Where the scanned JSON starts in the body, and how far the body is scanned.
        self._base = self._scanned = 0

    def _body_end(self, text: str) -> tuple[int, int] | None:
        if self._named is None:
            head = text.lstrip()
            if not head:
                return None
            if head[0] in "[{":
                self._named = False
            else:
                args = text.find(self.args_marker)
                if args < 0:
                    return None  # the name goes on
                self._named = True
                self._base = self._scanned = args + len(self.args_marker)
        self._scanner.scan(text[self._scanned :])
        self._scanned = len(text)
        end = self._scanner.value_end
        return None if end < 0 else (self._base + end, self._base + end)

    def _parse_body(self, body: str) -> list[tuple[str, str]] | None:
        if not self._named:
            return super()._parse_body(body)
        name, _, arguments = body.partition(self.args_marker)
        return _calls_in(json.dumps({"name": name.strip(), "arguments": arguments}))


class _Leading(enum.Enum):
    """What a Llama 3 turn turned out to be."""

    UNDECIDED = "undecided"  # only whitespace (or the python tag) so far
    CONTENT = "content"
    CALLS = "calls"


class Llama3JsonParser(_ContentAndCalls):
    """A turn that starts with ``{`` (after whitespace and ``<|python_tag|>``) is
    ``;``-separated call objects; any other turn is content."""

    python_tag = "<|python_tag|>"

    def __init__(self, parallel: bool) -> None:
        super().__init__(parallel)
        self._leading = _Leading.UNDECIDED
        self._buffer = ""
        self._scanner = ObjectScanner()
        self._consumed = 0  # offset in _buffer of the text not yet placed

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        if self._leading is _Leading.UNDECIDED:
            head = self._buffer.lstrip()
            if head.startswith(self.python_tag):
                head = head[len(self.python_tag) :].lstrip()
            if not head or self.python_tag.startswith(head):
                return out
            if not head.startswith("{"):
                self._leading = _Leading.CONTENT
            else:
                self._leading = _Leading.CALLS
                self._buffer = head
                text = head
        if self._leading is _Leading.CONTENT:
            out.content, self._buffer = self._buffer, ""
            return out
        for start, end in self._scanner.scan(text):
            self._between(out, self._buffer[self._consumed : start])
            calls = _calls_in(self._buffer[start:end])
            if calls is None:
                self._content(out, self._buffer[start:end])
            else:
                self._emit(out, calls)
            self._consumed = end
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._leading is not _Leading.CALLS:
            out.content, self._buffer = self._buffer, ""
            return out
        self._between(out, self._buffer[self._consumed :])
        self._finish_held(out)
        return out

    def _between(self, out: ParsedDelta, text: str) -> None:
        """Text between call objects: their separators, or content."""
        if text.strip().strip(";").strip():
            self._content(out, text)


class RequiredParser:
    """``tool_choice: required``: the grammar's JSON array of ``{"name", "parameters"}``;
    each call is handed back once its object is whole."""

    def __init__(self, parallel: bool) -> None:
        self._calls = _Calls(parallel)
        self._buffer = ""
        self._scanner = ObjectScanner(base_depth=1)

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        for start, end in self._scanner.scan(text):
            calls = _calls_in(self._buffer[start:end])
            if calls is not None:
                self._calls.emit(out, calls)
        return out

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class NamedParser:
    """A named ``tool_choice``: the whole text is that function's arguments, streamed as they
    come (the grammar keeps them to its schema)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    @property
    def num_calls(self) -> int:
        return int(self._started)

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self._started:
            return ParsedDelta(calls=[router_pb2.ToolCallDelta(index=0, arguments=text)])
        self._started = True
        return ParsedDelta(
            calls=[
                router_pb2.ToolCallDelta(index=0, id=new_call_id(), name=self._name, arguments=text)
            ]
        )

    def finish(self) -> ParsedDelta:
        """An empty call when the text was empty (cut off at once), so that one is always made."""
        if self._started:
            return ParsedDelta()
        self._started = True
        return ParsedDelta(
            calls=[router_pb2.ToolCallDelta(index=0, id=new_call_id(), name=self._name)]
        )


_AUTO_PARSERS: dict[ToolCallFormat, type[HermesParser | MistralParser | Llama3JsonParser]] = {
    ToolCallFormat.HERMES: HermesParser,
    ToolCallFormat.MISTRAL: MistralParser,
    ToolCallFormat.LLAMA3_JSON: Llama3JsonParser,
}


def auto_parser(call_format: ToolCallFormat, parallel: bool) -> ToolCallParser:
    return _AUTO_PARSERS[call_format](parallel)
