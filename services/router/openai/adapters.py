"""vLLM's runtime LoRA endpoints on the router: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (an admin key when keys are on), and the model names the API
answers (``resolve_model``)."""

from __future__ import annotations

from http import HTTPStatus

from pydantic import Field
from starlette.responses import PlainTextResponse

from services.router.lora_adapters import (
    LoraAdapters,
    ModelNotFoundError,
    RuntimeUpdatesDisabledError,
)
from services.router.openai.errors import OpenAIError
from services.router.openai.protocol import Body


class LoadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)


def resolve_model(adapters: LoraAdapters, model: str | None, served_name: str) -> str:
    """The model name a response carries: ``model`` when the router serves it (the model or
    one of its adapters), the served name when absent; 404 naming those served otherwise."""
    if model is None:
        return served_name
    try:
        adapters.resolve(model)
    except ModelNotFoundError as exc:
        raise OpenAIError(
            HTTPStatus.NOT_FOUND, str(exc), param="model", code="model_not_found"
        ) from None
    return model


async def load_adapter(adapters: LoraAdapters, body: LoadLoraAdapterRequest) -> PlainTextResponse:
    """Load on every worker (``LoraAdapters.load``); vLLM's answer on success."""
    try:
        await adapters.load(body.lora_name, body.lora_path)
    except (RuntimeUpdatesDisabledError, ValueError) as exc:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, str(exc), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_adapter(
    adapters: LoraAdapters, body: UnloadLoraAdapterRequest
) -> PlainTextResponse:
    """Unload from every worker serving it (``LoraAdapters.unload``)."""
    try:
        await adapters.unload(body.lora_name)
    except (RuntimeUpdatesDisabledError, ValueError) as exc:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, str(exc), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
