"""A request's tools and ``tool_choice``, validated: what the chat template shows the model,
the grammar that shapes a required call, and the parser that reads the calls back.

- ``auto`` (the default with tools): the model decides; its format's parser
  (``ToolCallFormat``) reads calls out of its text.
- ``none``: the template still shows the tools (as vLLM does); the text is content.
- ``required``: a JSON schema makes the text an array of one call or more (one without
  ``parallel_tool_calls``), each ``{"name": <a tool's>, "parameters": <its schema>}``.
- a named function: a JSON schema makes the text that function's arguments.

Every refusal is a ``ValueError`` naming the field, as ``request_prep``'s.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from services.router.tool_calls.parsers import (
    NamedParser,
    RequiredParser,
    ToolCallFormat,
    ToolCallParser,
    auto_parser,
)
from splitserve.v1 import router_pb2, worker_pb2

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolChoice(enum.Enum):
    """How the model may call the tools (OpenAI's ``tool_choice``)."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"  # one call of ``ToolUse.function_name``


_MODES = {
    router_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoice.AUTO,
    router_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoice.AUTO,
    router_pb2.TOOL_CHOICE_MODE_NONE: ToolChoice.NONE,
    router_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoice.REQUIRED,
}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A function the model may call; ``parameters`` is its arguments' JSON schema (None: the
    tool declared none)."""

    name: str
    description: str
    parameters: dict[str, Any] | None

    def for_template(self) -> dict[str, Any]:
        """OpenAI's shape, the one chat templates read."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters if self.parameters is not None else _ANY_OBJECT
        return {"type": "function", "function": function}

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else _ANY_OBJECT


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A request's validated tools and choice; ``call_format`` is how its model writes calls."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    function_name: str
    parallel: bool
    call_format: ToolCallFormat

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.for_template() for tool in self.tools]

    @property
    def needs_special_tokens(self) -> bool:
        """Its calls begin with a special token (Mistral's ``[TOOL_CALLS]``), which the text
        must then keep."""
        return self.choice is ToolChoice.AUTO and self.call_format is ToolCallFormat.MISTRAL

    @property
    def ends_turn(self) -> bool:
        """A generation that made calls finishes with ``tool_calls`` (a named choice's with
        ``stop``, as OpenAI's)."""
        return self.choice in (ToolChoice.AUTO, ToolChoice.REQUIRED)

    def constraint(self) -> worker_pb2.OutputConstraint | None:
        """The grammar of a required or named choice; None for ``auto`` and ``none``."""
        if self.choice is ToolChoice.NAMED:
            tool = next(t for t in self.tools if t.name == self.function_name)
            return _schema_constraint(tool.arguments_schema)
        if self.choice is not ToolChoice.REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": tool.arguments_schema,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return _schema_constraint(schema)

    def parser(self) -> ToolCallParser | None:
        """A new generation's parser; None with ``none`` (the text is all content)."""
        if self.choice is ToolChoice.NONE:
            return None
        if self.choice is ToolChoice.NAMED:
            return NamedParser(self.function_name)
        if self.choice is ToolChoice.REQUIRED:
            return RequiredParser(self.parallel)
        return auto_parser(self.call_format, self.parallel)


def tool_use(request: router_pb2.GenerateRequest, call_format: ToolCallFormat) -> ToolUse | None:
    """The request's tool use; None when it has no tools. ``ValueError`` naming the field for
    malformed tools, a choice they cannot satisfy, or tools without messages."""
    has_choice = request.HasField("tool_choice") and request.tool_choice.WhichOneof("choice")
    if not request.tools:
        if has_choice and request.tool_choice.mode != router_pb2.TOOL_CHOICE_MODE_NONE:
            raise ValueError("tool_choice: needs tools")
        return None
    if not request.messages:
        raise ValueError("tools: only chat requests (messages) can use tools")
    tools = tuple(_function_tool(i, tool) for i, tool in enumerate(request.tools))
    names = [tool.name for tool in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise ValueError(f"tools: two tools are named {duplicate!r}")
    choice, function_name = ToolChoice.AUTO, ""
    if request.HasField("tool_choice") and request.tool_choice.HasField("function_name"):
        choice, function_name = ToolChoice.NAMED, request.tool_choice.function_name
        if function_name not in names:
            raise ValueError(
                f"tool_choice.function_name: {function_name!r} is not one of the tools {names}"
            )
    elif request.HasField("tool_choice"):
        mode = request.tool_choice.mode
        if mode not in _MODES:
            raise ValueError(f"tool_choice.mode: {mode} is not a ToolChoiceMode")
        choice = _MODES[mode]
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    return ToolUse(tools, choice, function_name, parallel, call_format)


def _function_tool(i: int, tool: router_pb2.Tool) -> FunctionTool:
    if not _NAME.fullmatch(tool.name):
        raise ValueError(
            f"tools[{i}].name: {tool.name[:80]!r} must be 1 to 64 letters, digits, '_', '.' or '-'"
        )
    parameters = None
    if tool.parameters:
        try:
            parameters = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tools[{i}].parameters: not JSON: {exc}") from None
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].parameters: a JSON schema object is required")
    return FunctionTool(tool.name, tool.description, parameters)


def _schema_constraint(schema: dict[str, Any]) -> worker_pb2.OutputConstraint:
    return worker_pb2.OutputConstraint(json_schema=json.dumps(schema))
