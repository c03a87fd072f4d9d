"""Turn a parsed OpenAI request body into the router's ``GenerateRequest``s.

One HTTP request is ``len(prompts) x n`` generations: ``requests[p][j]`` is choice ``j`` of
prompt ``p`` (OpenAI's choice index ``p * n + j``). With a ``seed``, choice ``j`` samples with
``seed + j``: the choices differ from one another and the same request gives the same choices.
A request over its ``RequestBudget`` is refused here, before any generation starts.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from services.router.openai.errors import bad_request
from services.router.openai.prompt_echo import NO_ECHO, Echo
from services.router.openai.protocol import (
    INT64_MAX,
    MAX_GENERATIONS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    Tool,
)
from services.router.openai.structured import output_constraint
from services.router.request_prep import MaxTokensDefault
from splitserve.v1 import router_pb2

# OpenAI's newer name for the system role; chat templates know "system".
_ROLE_ALIASES = {"developer": "system"}
_TOOL_CHOICE_MODES = {
    "auto": router_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": router_pb2.TOOL_CHOICE_MODE_NONE,
    "required": router_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class Endpoint(enum.Enum):
    """Which API a request came through; it decides the response's shape."""

    CHAT = "chat.completion"
    COMPLETIONS = "text_completion"


@dataclass(frozen=True, slots=True)
class RequestBudget:
    """What one HTTP request may ask for: ``n`` (``--max-n``), logprobs (``--max-logprobs``)
    and generations x max_tokens (``--max-request-output-tokens``). Together they bound what
    the router holds for a whole response (its texts and logprobs)."""

    max_n: int
    max_logprobs: int
    max_output_tokens: int

    def check(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        num_generations: int,
        logprobs: tuple[tuple[str, int | None], ...],
        max_tokens: tuple[str, int | None],
        default_max_tokens: int | None,
    ) -> None:
        """``OpenAIError`` 400 naming the first field over its bound. Each of ``logprobs``
        and ``max_tokens`` is (field name, value or None), a negative logprobs value meaning the
        whole vocabulary; ``default_max_tokens`` is what a generation without max_tokens may
        produce (None: not known yet, so not checked)."""
        if body.n > self.max_n:
            raise bad_request(f"n: at most {self.max_n} (max_n), got {body.n}", "n")
        if num_generations > MAX_GENERATIONS:
            raise bad_request(
                f"prompt: {num_generations // body.n} prompts x n={body.n} is more than "
                f"{MAX_GENERATIONS} generations in one request",
                "prompt",
            )
        for field, value in logprobs:
            if value is not None and not 0 <= value <= self.max_logprobs:
                raise bad_request(
                    f"{field}: at most {self.max_logprobs} (max_logprobs), got {value}", field
                )
        field, value = max_tokens
        per_generation = value if value is not None else default_max_tokens
        if per_generation is None or num_generations * per_generation <= self.max_output_tokens:
            return
        unset = "" if value is not None else "not set, so "
        raise bad_request(
            f"{field}: {unset}{num_generations} generations x {per_generation} tokens is more "
            f"than {self.max_output_tokens} tokens per request (max_request_output_tokens)",
            field,
        )


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """The generations of one HTTP request, ``requests[prompt][choice]``."""

    endpoint: Endpoint
    requests: tuple[tuple[router_pb2.GenerateRequest, ...], ...]
    max_tokens_default: MaxTokensDefault
    echo: Echo = NO_ECHO

    @property
    def num_choices(self) -> int:
        return sum(len(choices) for choices in self.requests)


def chat_plan(
    body: ChatCompletionRequest,
    request_id: str,
    budget: RequestBudget,
    max_model_len: int | None,
) -> GenerationPlan:
    """The generations of a chat request (one prompt: its messages); ``OpenAIError`` 400 for
    content this server cannot take or a request over ``budget``, where a generation without
    max_tokens counts ``max_model_len`` tokens (None: not known yet)."""
    _refuse_unsupported(body.unsupported())
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    budget.check(
        body,
        body.n,
        (("top_logprobs", logprobs), ("prompt_logprobs", body.prompt_logprobs)),
        (max_tokens_field, max_tokens),
        max_model_len,
    )
    echo = Echo(num_prompt_logprobs=_prompt_logprobs_field(body))
    messages = chat_messages(body.messages)
    sampling = _sampling(body, max_tokens=max_tokens, logprobs=logprobs, echo=echo)
    prompt = router_pb2.GenerateRequest(
        messages=messages,
        cache_salt=body.cache_salt or "",
        priority=body.priority,
        model=body.model or "",
    )
    add_tools(prompt, body.tools, body.tool_choice, body.parallel_tool_calls)
    choices = _choices(prompt, sampling, body.n, request_id)
    # No max_tokens: the rest of the context, as OpenAI's chat API.
    return GenerationPlan(Endpoint.CHAT, (choices,), MaxTokensDefault.REST_OF_CONTEXT, echo)


def completion_plan(
    body: CompletionRequest, request_id: str, budget: RequestBudget
) -> GenerationPlan:
    """The generations of a completions request: ``n`` per prompt (a string, token ids, or a
    list of either); ``OpenAIError`` 400 for what this server cannot take or a request over
    ``budget``."""
    _refuse_unsupported(body.unsupported())
    prompts = _prompts(body.prompt)
    budget.check(
        body,
        len(prompts) * body.n,
        (("logprobs", body.logprobs), ("prompt_logprobs", body.prompt_logprobs)),
        ("max_tokens", body.max_tokens),
        SamplingParams().max_tokens,
    )
    echo = Echo(
        prompt=body.echo,
        without_generation=body.echo and body.max_tokens == 0,
        num_logprobs=body.logprobs if body.echo else None,
        num_prompt_logprobs=_prompt_logprobs_field(body),
    )
    # The prompt alone: the cluster samples one token, which the response leaves out.
    max_tokens = 1 if echo.without_generation else body.max_tokens
    sampling = _sampling(body, max_tokens=max_tokens, logprobs=body.logprobs, echo=echo)
    requests = []
    for p, prompt in enumerate(prompts):
        message = router_pb2.GenerateRequest(
            cache_salt=body.cache_salt or "", priority=body.priority, model=body.model or ""
        )
        if isinstance(prompt, str):
            message.prompt = prompt
        else:
            message.token_ids.extend(prompt)
        label = request_id if len(prompts) == 1 else f"{request_id}-{p}"
        requests.append(_choices(message, sampling, body.n, label))
    # OpenAI's completions default is 16 tokens, the engine's.
    return GenerationPlan(Endpoint.COMPLETIONS, tuple(requests), MaxTokensDefault.ENGINE, echo)


def _prompt_logprobs_field(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The ``prompt_logprobs`` the response carries: none in a stream (vLLM's, where only 0
    is allowed, and returns nothing)."""
    return None if body.stream else body.prompt_logprobs


def _refuse_unsupported(unsupported: tuple[str, str] | None) -> None:
    if unsupported is not None:
        param, why = unsupported
        raise bad_request(why, param)


def add_tools(
    request: router_pb2.GenerateRequest,
    tools: list[Tool] | None,
    choice: str | NamedToolChoice | None = None,
    parallel_tool_calls: bool | None = None,
) -> None:
    """A body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, in the router's terms."""
    for tool in tools or ():
        function = tool.function
        parameters = json.dumps(function.parameters) if function.parameters is not None else ""
        request.tools.add(
            name=function.name, description=function.description, parameters=parameters
        )
    if isinstance(choice, NamedToolChoice):
        request.tool_choice.function_name = choice.function.name
    elif choice is not None:
        request.tool_choice.mode = _TOOL_CHOICE_MODES[choice]
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls


def chat_messages(messages: list[ChatMessage]) -> list[router_pb2.ChatMessage]:
    """The router's messages of a chat body's: text content only (parts joined by newlines),
    OpenAI's ``developer`` role as ``system``, and the tool calls and results of the history;
    ``OpenAIError`` 400 naming other content."""
    converted = []
    for i, message in enumerate(messages):
        if message.content is None or isinstance(message.content, str):
            text = message.content or ""
        else:
            parts = []
            for k, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{k}]: content of type {part.type!r} is not "
                        "supported (only text)",
                        f"messages[{i}].content[{k}].type",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        role = _ROLE_ALIASES.get(message.role, message.role)
        calls = [
            router_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in message.tool_calls or ()
        ]
        converted.append(
            router_pb2.ChatMessage(
                role=role,
                content=text,
                tool_calls=calls,
                tool_call_id=message.tool_call_id or "",
                name=message.name or "",
            )
        )
    return converted


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # a list of token ids: one prompt
    return list(prompt)  # strings or token id lists


def _sampling(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    echo: Echo,
) -> router_pb2.SamplingParams:
    sampling = router_pb2.SamplingParams(
        stop=body.stop_strings(),
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
    )
    for name in _SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None:
            setattr(sampling, name, value)
    if body.seed is not None:
        sampling.seed = body.seed
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if logprobs is not None:
        sampling.logprobs = logprobs
    if echo.num_computed is not None:
        sampling.prompt_logprobs = echo.num_computed
    constraint = output_constraint(body)
    if constraint is not None:
        sampling.constraint.CopyFrom(constraint)
    return sampling


def _choices(
    prompt: router_pb2.GenerateRequest,
    sampling: router_pb2.SamplingParams,
    n: int,
    label: str,
) -> tuple[router_pb2.GenerateRequest, ...]:
    choices = []
    for j in range(n):
        request = router_pb2.GenerateRequest()
        request.CopyFrom(prompt)
        request.request_id = label if n == 1 else f"{label}-{j}"
        request.sampling.CopyFrom(sampling)
        if j and sampling.HasField("seed") and sampling.seed >= 0:
            request.sampling.seed = (sampling.seed + j) % (INT64_MAX + 1)
        if j:  # the first choice's serve every choice of the prompt (prompt_echo)
            request.sampling.ClearField("prompt_logprobs")
        choices.append(request)
    return tuple(choices)
