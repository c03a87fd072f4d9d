"""Validate a client's ``GenerateRequest`` and turn it into token ids plus engine params.

Every rejection is a ``ValueError`` whose message names the offending field; the server maps it
to ``INVALID_ARGUMENT``. Checks that need the model (vocabulary, context length) use the
``WorkerInfo`` the workers report, so the router and the engines agree on the limits.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from dataclasses import dataclass

import jinja2

from engine.block_hash import block_extra_key
from engine.request_limits import check_client_cache_salt, check_request_limits
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.tokenizer import Tokenizer
from services.common.convert import (
    CONSTRAINT_LIMITS,
    constraint_from_proto,
    sampling_params_from_client,
)
from services.router.tool_calls.parsers import ToolCallFormat
from services.router.tool_calls.rendering import template_inputs
from services.router.tool_calls.tool_use import ToolUse, tool_use
from services.router.worker_pool import ServedTarget
from splitserve.v1 import router_pb2

MAX_REQUEST_ID_CHARS = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class MaxTokensDefault(enum.Enum):
    """What a request that sets no ``max_tokens`` gets: the engine's default (16, as OpenAI's
    completions API), or the rest of the context (OpenAI's chat API)."""

    ENGINE = "engine"
    REST_OF_CONTEXT = "rest-of-context"


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the decode workers' model takes: its vocabulary and longest sequence."""

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class RequestBounds:
    """Sizes of a request's text (``--max-prompt-bytes``, ``--max-messages``), its logprobs
    (``--max-logprobs``) and its ``max_tokens`` (``--max-request-output-tokens``), checked
    before any tokenization so that no request costs more than they allow. The other sizes of
    its sampling fields are ``SamplingParams``' own bounds (stop strings, stop token ids)."""

    max_prompt_bytes: int = 4 * 2**20
    max_messages: int = 1024
    max_logprobs: int = MAX_LOGPROBS
    max_tokens: int = 262144

    def check(self, request: router_pb2.GenerateRequest) -> None:
        """Raise ``ValueError`` naming the field of the first size over its bound."""
        sampling = request.sampling
        for name in ("logprobs", "prompt_logprobs"):
            if sampling.HasField(name) and getattr(sampling, name) > self.max_logprobs:
                raise ValueError(
                    f"sampling.{name}: {getattr(sampling, name)}, more than {self.max_logprobs} "
                    "(max_logprobs)"
                )
        if sampling.HasField("max_tokens") and sampling.max_tokens > self.max_tokens:
            raise ValueError(
                f"sampling.max_tokens: {sampling.max_tokens}, more than {self.max_tokens} "
                "(max_request_output_tokens)"
            )
        num_messages = len(request.messages)
        if num_messages > self.max_messages:
            raise ValueError(f"messages: {num_messages} messages, more than {self.max_messages}")
        num_bytes = (
            len(request.prompt.encode())
            + sum(_message_bytes(m) for m in request.messages)
            + sum(len(t.description.encode()) + len(t.parameters.encode()) for t in request.tools)
        )
        if num_bytes > self.max_prompt_bytes:
            field = "messages" if num_messages else "prompt"
            raise ValueError(f"{field}: {num_bytes} bytes, more than {self.max_prompt_bytes}")


def _message_bytes(message: router_pb2.ChatMessage) -> int:
    calls = sum(len(c.arguments.encode()) + len(c.name) + len(c.id) for c in message.tool_calls)
    return len(message.content.encode()) + calls


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request. ``req_id`` is the router's: unique across routers and time, it
    keys the request on the workers (its engine entries, KV leases, releases). The client's
    ``request_id`` is only a label (``client_request_id``), echoed in responses and logged.
    ``tools``: its tool use (None without tools), whose parser reads the calls back.
    ``priority``: the workers' scheduling priority (lower first; None: the tenant's)."""

    req_id: str
    client_request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    tools: ToolUse | None = None
    priority: int | None = None
    # The served model it is for, the LoRA adapter its model names ("": the base model), and
    # the key the workers hash the adapter's blocks with.
    model: str = ""
    lora_name: str = ""
    lora_block_key: str = ""

    @property
    def target(self) -> ServedTarget:
        """The workers it may run on: those of its model (and adapter)."""
        return ServedTarget(self.model, self.lora_name)

    @property
    def block_extra_key(self) -> str:
        """What the workers put into the request's block hashes: its salt and adapter."""
        return block_extra_key(self.cache_salt, self.lora_block_key)


def prepare_request(
    request: router_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    bounds: RequestBounds = RequestBounds(),
    max_tokens_default: MaxTokensDefault = MaxTokensDefault.ENGINE,
    tool_call_format: ToolCallFormat = ToolCallFormat.HERMES,
) -> PreparedRequest:
    """Raises ``ValueError`` naming the field when the request cannot be served. Tokenizes and
    renders chat templates: CPU work that callers on an event loop run in a thread.
    ``tool_call_format``: how the model writes tool calls (``--tool-call-parser``)."""
    bounds.check(request)
    req_id = uuid.uuid4().hex
    client_request_id = request.request_id or req_id
    if len(client_request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters")
    check_client_cache_salt(request.cache_salt)
    tools = tool_use(request, tool_call_format)
    try:
        params = sampling_params_from_client(_with_tool_constraint(request.sampling, tools))
    except ValueError as exc:
        raise ValueError(f"sampling.{exc}") from None
    if tools is not None and tools.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    prompt_token_ids = chat_or_prompt_token_ids(request, tokenizer, tools=tools)
    if max_tokens_default is MaxTokensDefault.REST_OF_CONTEXT and not request.sampling.HasField(
        "max_tokens"
    ):
        rest_tokens = max(limits.max_model_len - len(prompt_token_ids), 1)
        params = dataclasses.replace(params, max_tokens=rest_tokens)
    _check_limits(prompt_token_ids, params, limits)
    return PreparedRequest(
        req_id,
        client_request_id,
        prompt_token_ids,
        params,
        request.cache_salt,
        tools,
        request.priority if request.HasField("priority") else None,
    )


def _with_tool_constraint(
    sampling: router_pb2.SamplingParams, tools: ToolUse | None
) -> router_pb2.SamplingParams:
    """``sampling`` with the grammar of a required or named tool choice (refused beside a
    constraint of the client's own, or over the constraint budget: checked before the tools
    are rendered and tokenized, which costs more)."""
    constraint = tools.constraint() if tools is not None else None
    if constraint is None:
        return sampling
    try:
        CONSTRAINT_LIMITS.check(constraint_from_proto(constraint))
    except ValueError as exc:
        raise ValueError(f"tools: the grammar of their schemas: {exc}") from None
    if sampling.HasField("constraint"):
        raise ValueError(
            "tool_choice: a required or named tool choice sets the output's grammar, so "
            "sampling.constraint must be unset"
        )
    constrained = router_pb2.SamplingParams()
    constrained.CopyFrom(sampling)
    constrained.constraint.CopyFrom(constraint)
    return constrained


def chat_or_prompt_token_ids(
    request: router_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    tools: ToolUse | None = None,
) -> list[int]:
    """The prompt of ``request``: its token ids, its prompt tokenized, or its messages rendered
    by the chat template with ``tools`` (ending with the assistant's turn unless not
    ``add_generation_prompt``); ``ValueError`` naming the field."""
    given = [
        name
        for name, present in (
            ("prompt", request.HasField("prompt")),
            ("token_ids", bool(request.token_ids)),
            ("messages", bool(request.messages)),
        )
        if present
    ]
    if not given:
        raise ValueError("prompt: one of prompt, token_ids or messages is required")
    if len(given) > 1:
        raise ValueError(
            f"{given[0]}: only one of prompt, token_ids, messages may be set; got {given}"
        )
    if request.HasField("prompt"):
        if not request.prompt:
            raise ValueError("prompt: must not be empty")
        return tokenizer.encode(request.prompt)
    if request.token_ids:
        return list(request.token_ids)
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role: {message.role!r} is not one of {sorted(CHAT_ROLES)}"
            )
    messages, template_tools = template_inputs(request.messages, tools, tokenizer.chat_template)
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt, tools=template_tools)
    except (jinja2.TemplateError, ValueError) as exc:
        raise ValueError(f"messages: the chat template rejected them: {exc}") from None
    if not ids:
        raise ValueError("messages: rendered to an empty prompt")
    return ids


def _check_limits(prompt_token_ids: list[int], params: SamplingParams, limits: ModelLimits) -> None:
    check_request_limits(
        prompt_token_ids,
        params,
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
    )
    # Only the router checks these: an engine simply never samples an id outside its vocabulary.
    bad_stop = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad_stop is not None:
        raise ValueError(
            f"sampling.stop_token_ids: id {bad_stop} is outside the vocabulary "
            f"[0, {limits.vocab_size})"
        )
