"""OpenAI's error responses: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status a client library maps to its exception classes (400 ``BadRequestError``, 401
``AuthenticationError``, 403 ``PermissionDeniedError``, 404 ``NotFoundError``, 429
``RateLimitError``, 5xx ``InternalServerError``)."""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass
from http import HTTPStatus
from typing import Any

import grpc
from pydantic import ValidationError

from services.common.failures import RETRY_AFTER
from services.router.call_context import CallAborted

_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_TIMEOUT: "timeout_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
}
_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}
# "max_tokens: ...", "temperature must be ...", "messages[0].role: ...": the router's
# validation messages start with the field.
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w.]*(?:\[\d+\][\w.]*)*)[: ]")
# The router's messages name the gRPC request's fields; the HTTP body has them at the top.
_GRPC_PREFIX = "sampling."
# How pydantic names the members of a union in an error's location.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


@dataclass(eq=False)
class OpenAIError(Exception):
    """An error response: ``status`` and the body's fields (``param`` and ``code`` by
    keyword)."""

    status: HTTPStatus
    message: str
    _: KW_ONLY
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None  # e.g. retry-after of a 429

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param)


def from_call_aborted(exc: CallAborted) -> OpenAIError:
    """The HTTP error for a generation the router refused or failed (its gRPC status)."""
    status = _STATUS_OF_CODE.get(exc.code, HTTPStatus.INTERNAL_SERVER_ERROR)
    message = exc.details.removeprefix(_GRPC_PREFIX)
    param = None
    if status is HTTPStatus.BAD_REQUEST:
        match = _LEADING_FIELD.match(message)
        param = match.group(1) if match else None
    code = "invalid_value" if status is HTTPStatus.BAD_REQUEST else exc.code.name.lower()
    headers = {key: value for key, value in exc.trailing_metadata if key == RETRY_AFTER}
    return OpenAIError(status, message, param=param, code=code, headers=headers or None)


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The 400 for a body that does not parse: its first error, naming the field."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first['msg']}")
    location = ""
    for part in first["loc"]:
        if isinstance(part, int):
            location += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part:
            # A union's member (prompt: str | list[int] | ...): none of them matched.
            return bad_request(f"{location}: not a value of any accepted type", location)
        else:
            location += f".{part}" if location else part
    if not location:
        return bad_request(f"the body must be a JSON object: {first['msg']}")
    return bad_request(f"{location}: {first['msg']}", location)
