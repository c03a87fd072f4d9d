"""The HTTP API's routes (FastAPI): OpenAI's endpoints plus health, version and status.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: a data key when keys are on.
- ``GET /v1/models``: the served model and its LoRA adapters, with the context length (a data
  key). A request's ``model`` names one of them (absent: the model); another is 404.
- ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``: vLLM's, with an admin key
  (and only with ``--allow-runtime-lora-updating``).
- ``POST /tokenize``, ``POST /detokenize``: vLLM's, on the model's tokenizer (a data key).
- ``GET /metrics``: the router's Prometheus metrics, as on ``--metrics-port`` (no key, as
  vLLM's: clients and benchmark tools probe it there; it holds no request content).
- ``GET /health``: 200 while at least one decode worker serves, else 503 (no key: probes).
- ``GET /version``: 200 whenever the server runs (no key: liveness).
- ``GET /status``: ``Router.Status`` as JSON (an admin key, as the RPC).

Keys are the router's (``Authorization: Bearer KEY``): a missing or unknown one is 401, a data
key on ``/status`` 403. Every error body is OpenAI's shape (``errors``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from services.common.api_keys import BEARER_PREFIX, ApiKeyStore, KeyRole
from services.router.auth import CALLER
from services.router.call_context import HttpCallContext
from services.router.openai.adapters import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    load_adapter,
    resolve_model,
    unload_adapter,
)
from services.router.openai.body_parser import BodyParser
from services.router.openai.choices import respond
from services.router.openai.errors import OpenAIError, bad_request
from services.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamUsage,
)
from services.router.openai.requests import (
    GenerationPlan,
    RequestBudget,
    chat_plan,
    completion_plan,
)
from services.router.openai.responses import ResponseBuilder, TokenTexts
from services.router.openai.streaming import (
    error_response,
)
from services.router.openai.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from services.router.served_models import ServedModel
from splitserve.v1 import router_pb2

if TYPE_CHECKING:
    from services.router.server import RouterServicer

logger = logging.getLogger(__name__)

# The client's own request id, used as the generations' label (as vLLM reads it).
REQUEST_ID_HEADER = "x-request-id"
_AUTHORIZATION = "authorization"
_MAX_REQUEST_ID_CHARS = 128

BodyT = TypeVar("BodyT", bound=BaseModel)


def build_app(
    servicer: RouterServicer, api_keys: ApiKeyStore, max_body_bytes: int, bodies: BodyParser
) -> FastAPI:
    """The HTTP API of ``servicer``'s router, taking ``api_keys``; bodies over
    ``max_body_bytes`` are refused (413) before they are parsed, the others parsed by
    ``bodies``."""
    app = FastAPI(title="splitserve", version=_version(), docs_url=None, redoc_url=None)
    api = _Api(servicer, api_keys, max_body_bytes, bodies)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(OpenAIError(HTTPStatus(exc.status_code), str(exc.detail)))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # Gone during its upload: the connection has logged it, and nobody reads an answer.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(bad_request(str(exc)))

    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/status", api.status, methods=["GET"])
    return app


def _version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _Api:
    """The route handlers, bound to one router."""

    def __init__(
        self,
        servicer: RouterServicer,
        api_keys: ApiKeyStore,
        max_body_bytes: int,
        bodies: BodyParser,
    ) -> None:
        self._servicer = servicer
        self._keys = api_keys
        self._max_body_bytes = max_body_bytes
        config = servicer.config
        self._budget = RequestBudget(
            config.max_n, config.max_logprobs, config.max_request_output_tokens
        )
        # Each served model's, made on its first response.
        self._token_texts: dict[str, TokenTexts] = {}
        self._created_s = int(time.time())
        self._bodies = bodies

    # ----------------------------------------------------------------------------- generation
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request, KeyRole.DATA)
        body = await self._parse(request, ChatCompletionRequest)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        _, served = self._resolve(body.model)
        max_model_len = self._max_model_len(served)
        plan = chat_plan(body, _label(request, response_id), self._budget, max_model_len)
        return await self._respond(request, plan, body, response_id)

    async def completions(self, request: Request) -> Response:
        self._authorize(request, KeyRole.DATA)
        body = await self._parse(request, CompletionRequest)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        plan = completion_plan(body, _label(request, response_id), self._budget)
        return await self._respond(request, plan, body, response_id)

    async def _respond(
        self,
        request: Request,
        plan: GenerationPlan,
        body: ChatCompletionRequest | CompletionRequest,
        response_id: str,
    ) -> Response:
        model, served = self._resolve(body.model)
        token_texts = self._token_texts.get(served.name)
        if token_texts is None:
            token_texts = self._token_texts[served.name] = TokenTexts(served.tokenizer)
        # Stamped per response, as OpenAI's and vLLM's.
        builder = ResponseBuilder(plan, response_id, model, int(time.time()), token_texts)
        options = body.stream_options
        usage = options.usage if options is not None else StreamUsage.NONE
        return await respond(self._servicer, request, builder, bool(body.stream), usage)

    # ----------------------------------------------------------------------------- the rest
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request, KeyRole.DATA)
        models = self._servicer.models
        # (id, root, parent, max_model_len): every served model, then every adapter.
        entries: list[tuple[str, str, str | None, int | None]] = []
        for name in models.names():
            served = models.get(name)
            assert served is not None
            entries.append((name, served.model, None, self._max_model_len(served)))
        for name, adapter in models.adapters.served().items():
            base = models.get(adapter.base_model)
            if base is not None:
                entries.append((name, name, base.name, self._max_model_len(base)))
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self._created_s,
                    "owned_by": "splitserve",
                    "root": root,
                    "parent": parent,
                    "max_model_len": max_model_len,
                }
                for name, root, parent, max_model_len in entries
            ],
        }

    async def load_lora_adapter(self, request: Request) -> Response:
        self._authorize(request, KeyRole.ADMIN)
        body = await self._parse(request, LoadLoraAdapterRequest)
        return await load_adapter(self._servicer.models, body)

    async def unload_lora_adapter(self, request: Request) -> Response:
        self._authorize(request, KeyRole.ADMIN)
        body = await self._parse(request, UnloadLoraAdapterRequest)
        return await unload_adapter(self._servicer.models.adapters, body)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        self._authorize(request, KeyRole.DATA)
        body = await self._parse(request, TokenizeRequest)
        _, served = self._resolve(body.model)
        max_model_len = self._max_model_len(served)
        return await asyncio.to_thread(tokenize, body, served.tokenizer, max_model_len)

    async def detokenize(self, request: Request) -> dict[str, Any]:
        self._authorize(request, KeyRole.DATA)
        body = await self._parse(request, DetokenizeRequest)
        _, served = self._resolve(body.model)
        return await asyncio.to_thread(detokenize, body, served.tokenizer)

    async def metrics(self) -> Response:
        exposition = await asyncio.to_thread(generate_latest, REGISTRY)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> Response:
        num_ready = sum(w.routable for w in self._servicer.decode_pool.workers)
        if not num_ready:
            return error_response(
                OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "no decode worker is ready")
            )
        return JSONResponse({"status": "ok", "num_decode_workers_ready": num_ready})

    async def version(self) -> dict[str, str]:
        return {"version": _version()}

    async def status(self, request: Request) -> dict[str, Any]:
        self._authorize(request, KeyRole.ADMIN)
        status = await self._servicer.Status(router_pb2.StatusRequest(), HttpCallContext())
        return MessageToDict(status, preserving_proto_field_name=True)

    # ----------------------------------------------------------------------------- checks
    def _resolve(self, model: str | None) -> tuple[str, ServedModel]:
        """The name responses carry and the model that answers; 404 for a model not served
        (``resolve_model``)."""
        return resolve_model(self._servicer.models, model)

    def _max_model_len(self, served: ServedModel) -> int | None:
        limits = self._servicer.models.limits(served.name)
        return limits.max_model_len if limits is not None else None

    def _authorize(self, request: Request, needed: KeyRole) -> None:
        if not self._keys.enabled:
            return
        presented = request.headers.get(_AUTHORIZATION)
        key = self._keys.authenticate(presented)
        if key is None:
            raise OpenAIError(
                HTTPStatus.UNAUTHORIZED, _why_refused(presented), code="invalid_api_key"
            )
        if not key.role.allows(needed):
            raise OpenAIError(
                HTTPStatus.FORBIDDEN,
                f"{request.url.path} needs an admin API key; this one (key {key.fingerprint}) "
                "is a data key",
                code="permission_denied",
            )
        CALLER.set(key)

    async def _parse(self, request: Request, model: type[BodyT]) -> BodyT:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise _too_large(self._max_body_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body_bytes:
                raise _too_large(self._max_body_bytes)
            chunks.append(chunk)
        return await self._bodies.parse(model, b"".join(chunks))


def _label(request: Request, response_id: str) -> str:
    """The generations' label in the router's logs: the client's X-Request-Id, else the
    response's id."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given[:_MAX_REQUEST_ID_CHARS] or response_id


def _too_large(max_body_bytes: int) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"the request body is larger than {max_body_bytes} bytes",
    )


def _why_refused(presented: str | None) -> str:
    if not presented:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    if not presented.startswith(BEARER_PREFIX):
        return "malformed Authorization header: expected 'Bearer <key>'"
    return "invalid API key"
