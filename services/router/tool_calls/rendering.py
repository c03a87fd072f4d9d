"""A conversation with tools as the chat template reads it.

Messages go to the template in OpenAI's shape (an assistant's ``tool_calls`` with their
arguments as objects, as Hugging Face templates expect; a tool message's ``tool_call_id``),
and the tools as ``tools``. A template written without tools (SmolLM2's, plain ChatML) would
drop them silently, so for one that never reads ``tools`` the conversation is rewritten in
Hermes' convention, which ``ToolCallFormat.HERMES`` then parses: the tools in the system
message, an assistant's calls as ``<tool_call>`` blocks in its content, a tool's result as a
user message in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.router.tool_calls.parsers import ToolCallFormat
from services.router.tool_calls.tool_use import ToolUse
from splitserve.v1 import router_pb2

_HERMES_SYSTEM = (
    "You can call functions to answer the user. The functions, as JSON schemas, are within "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call one, answer with a JSON object of "
    "its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The format a model's template shows its calls in; Hermes' for a template without tools
    (the conversation is then rendered in it)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return ToolCallFormat.MISTRAL
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return ToolCallFormat.LLAMA3_JSON
    return ToolCallFormat.HERMES


def template_inputs(
    messages: Sequence[router_pb2.ChatMessage],
    tools: ToolUse | None,
    chat_template: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template; ``ValueError`` naming a call whose arguments are
    not a JSON object."""
    converted = [_message(i, message) for i, message in enumerate(messages)]
    has_calls = any("tool_calls" in m or m["role"] == "tool" for m in converted)
    if template_knows_tools(chat_template) or not (tools or has_calls):
        return converted, tools.template_tools() if tools is not None else None
    return _as_hermes(converted, tools), None


def _message(i: int, message: router_pb2.ChatMessage) -> dict[str, Any]:
    converted: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        converted["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": _arguments(call.arguments, f"messages[{i}].tool_calls[{k}]"),
                },
            }
            for k, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id:
        converted["tool_call_id"] = message.tool_call_id
    if message.name:
        converted["name"] = message.name
    return converted


def _arguments(text: str, field: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field}.arguments: not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{field}.arguments: a JSON object is required")
    return arguments


def _as_hermes(messages: list[dict[str, Any]], tools: ToolUse | None) -> list[dict[str, Any]]:
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            content = f"<tool_response>\n{message['content']}\n</tool_response>"
            rendered.append({"role": "user", "content": content})
            continue
        content = message["content"]
        for call in message.get("tool_calls", ()):
            function = call["function"]
            body = json.dumps(
                {"name": function["name"], "arguments": function["arguments"]},
                ensure_ascii=False,
            )
            content += f"{chr(10) if content else ''}<tool_call>\n{body}\n</tool_call>"
        rendered.append({"role": message["role"], "content": content})
    if tools is None or not tools.tools:
        return rendered
    listing = "\n".join(
        json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools.template_tools()
    )
    system = _HERMES_SYSTEM.format(tools=listing)
    if rendered and rendered[0]["role"] == "system":
        first = rendered[0]
        return [{"role": "system", "content": f"{first['content']}\n\n{system}"}, *rendered[1:]]
    return [{"role": "system", "content": system}, *rendered]
