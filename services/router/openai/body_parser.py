"""Request bodies parsed into their models, the large ones in a helper process.

Parsing holds the GIL throughout, and its cost grows with the number of JSON values, not bytes:
1.6 MB of prompt text parses in about 1 ms, but a 1.6 MB list of 100,000 strings (a hostile
``guided_choice``) takes 20 to 40 ms and 100,000 token ids about 60 ms (2-core EPYC). On the
router's event loop, that time is lost to every other request's first token. So bodies over
``LARGE_BODY_BYTES`` are parsed in one helper process, started at the first of them, one at a
time within a duty cycle (``share`` of the wall clock: a stream of expensive bodies slows
itself, not the host's other work). The helper also runs the checks that need the parsed body
and whose refusal is cheaper to send back than the body (a constraint over its size budget comes
back as its 400 alone, not as 100,000 strings to unpickle). Small bodies parse inline: the round
trip to the helper costs more than their parse.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from services.router.openai.duty_cycle import DutyCycle
from services.router.openai.errors import OpenAIError, from_validation_error
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.router.openai.structured import output_constraint

logger = logging.getLogger(__name__)

LARGE_BODY_BYTES = 256 * 1024
# The helper's share of the wall clock: a hostile stream of 35 ms parses gets ~3 a second.
HELPER_SHARE = 0.1

BodyT = TypeVar("BodyT", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class _Refusal:
    """An ``OpenAIError`` as the helper sends it back (exceptions with keyword-only arguments
    do not pickle)."""

    status: HTTPStatus
    message: str
    param: str | None
    code: str | None

    def error(self) -> OpenAIError:
        return OpenAIError(self.status, self.message, param=self.param, code=self.code)


class BodyParser:
    """Parses request bodies; ``close`` stops the helper process (a later large body starts
    another)."""

    def __init__(
        self, share: float = HELPER_SHARE, large_body_bytes: int = LARGE_BODY_BYTES
    ) -> None:
        self._duty = DutyCycle(share)
        self._large_body_bytes = large_body_bytes
        self._helper: ProcessPoolExecutor | None = None

    async def parse(self, model: type[BodyT], data: bytes) -> BodyT:
        """``data`` as a ``model``; ``OpenAIError`` 400 naming the field when it is not one (or,
        for a large body, when its output constraint is over the size budget), 503 when the
        helper process died during the parse."""
        if len(data) <= self._large_body_bytes:
            return _validated(model, data)
        outcome = await self._duty.run(lambda: self._in_helper(model, data))
        if isinstance(outcome, _Refusal):
            raise outcome.error()
        return outcome

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False, cancel_futures=True)
            self._helper = None

    async def _in_helper(self, model: type[BodyT], data: bytes) -> BodyT | _Refusal:
        if self._helper is None:
            # Not fork: the router's gRPC threads would be copied mid-flight.
            self._helper = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))
        helper = self._helper
        try:
            return await asyncio.wrap_future(helper.submit(_parse_checked, model, data))
        except BrokenProcessPool:
            logger.warning("the body-parsing helper stopped; the next large body starts another")
            if self._helper is helper:
                self.close()
            raise OpenAIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the router's body parser stopped while parsing this request; send it again",
            ) from None


def _validated(model: type[BodyT], data: bytes) -> BodyT:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _parse_checked(model: type[BodyT], data: bytes) -> BodyT | _Refusal:
    """In the helper: the parsed body, or why it is refused."""
    try:
        body = _validated(model, data)
        if isinstance(body, ChatCompletionRequest | CompletionRequest):
            output_constraint(body)
    except OpenAIError as exc:
        return _Refusal(exc.status, exc.message, exc.param, exc.code)
    return body
