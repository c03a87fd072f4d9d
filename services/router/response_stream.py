"""Turn the token batches workers send into the client's stream of ``GenerateResponse``s.

The router owns text: it detokenizes incrementally, enforces stop strings (no text past one;
the worker is then cancelled), puts the running ``usage`` on every message (final on the last:
vLLM's ``continuous_usage_stats``) and fills ``finish_reason`` on the last.
Like the offline engine, a stop token (eos / stop_token_ids) adds no text. With tools, the text
goes through the request's tool-call parser: messages carry the content and the calls' pieces
(``tool_calls``), and a turn that called tools finishes with ``tool_calls``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from services.common.convert import FINISH_REASONS
from services.router.tool_calls.tool_use import ToolUse
from splitserve.v1 import router_pb2, worker_pb2


class ResponseStream:
    """Per-request state of the client stream. ``finished`` once the last message is built."""

    def __init__(
        self,
        req_id: str,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        tools: ToolUse | None = None,
    ) -> None:
        self.req_id = req_id
        self._tool_parser = tools.parser() if tools is not None else None
        self._calls_end_turn = tools is not None and tools.ends_turn
        self.num_prompt_tokens = len(prompt_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer.backend, prompt_token_ids, params)
        self.output_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.num_tier_tokens = 0  # of num_cached_tokens, loaded from a worker's tier
        self.finished = False
        # Sent on the first message when prompt_logprobs are asked for.
        self._prompt_token_ids = prompt_token_ids if params.prompt_logprobs is not None else ()

    def push(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[worker_pb2.TokenLogprob] = (),
        *,
        finish_reason: str = "",
        stop_reason: str = "",
        prompt_logprobs: Sequence[worker_pb2.TokenLogprob] = (),
    ) -> router_pb2.GenerateResponse:
        """Append a worker's new tokens; return the client message for them.

        ``finish_reason`` / ``stop_reason`` are the worker's (``stop`` with a token id means the
        last token is a stop token). A stop string matched here finishes the stream too; tokens
        after the one completing it are dropped. ``prompt_logprobs`` (with the first token)
        pass through; the first message of a request with prompt_logprobs carries its prompt.
        """
        assert not self.finished, "push() after the stream finished"
        stop_by_token = finish_reason == "stop" and bool(stop_reason)
        text_ids = token_ids[:-1] if stop_by_token else token_ids
        kept = list(token_ids)
        stop_str = None
        for i, token_id in enumerate(text_ids):
            stop_str = self.detokenizer.update([token_id])
            if stop_str is not None:
                kept = kept[: i + 1]
                finish_reason, stop_reason = "stop", stop_str
                break
        self.output_token_ids.extend(kept)
        self.finished = bool(finish_reason)
        message = router_pb2.GenerateResponse(
            request_id=self.req_id,
            token_ids=kept,
            text=self.detokenizer.take_delta(self.finished),
            logprobs=list(logprobs)[: len(kept)],
            usage=self.usage(),
            prompt_logprobs=prompt_logprobs,
        )
        if self._prompt_token_ids:  # the first message
            message.prompt_token_ids.extend(self._prompt_token_ids)
            self._prompt_token_ids = ()
        if self._tool_parser is not None:
            self._parse_tool_calls(message)
        if self.finished:
            parser = self._tool_parser
            if (
                finish_reason == "stop"
                and parser is not None
                and parser.num_calls
                and self._calls_end_turn
            ):
                finish_reason = "tool_calls"
            message.finish_reason = FINISH_REASONS[finish_reason]
            message.stop_reason = stop_reason
        return message

    def _parse_tool_calls(self, message: router_pb2.GenerateResponse) -> None:
        """Split ``message.text`` into its content and its call pieces, in place."""
        parser = self._tool_parser
        assert parser is not None
        parsed = parser.feed(message.text)
        if self.finished:
            parsed.add(parser.finish())
        message.text = parsed.content
        message.tool_calls.extend(parsed.calls)

    def usage(self) -> router_pb2.Usage:
        return router_pb2.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.output_token_ids),
            cached_tokens=self.num_cached_tokens,
        )
