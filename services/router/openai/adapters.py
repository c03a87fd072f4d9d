"""vLLM's runtime LoRA endpoints on the router: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (an admin key when keys are on), and the model names the API
answers (``resolve_model``)."""

from __future__ import annotations

from http import HTTPStatus

from pydantic import Field
from starlette.responses import PlainTextResponse

from services.router.lora_adapters import LoraAdapters, RuntimeUpdatesDisabledError
from services.router.openai.errors import OpenAIError
from services.router.openai.protocol import Body
from services.router.served_models import ModelNotFoundError, ServedModel, ServedModels


class LoadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # Beyond vLLM's (one model per server): the served model the adapter is for (default:
    # the router's --model).
    base_model_name: str = ""


class UnloadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)


def resolve_model(models: ServedModels, model: str | None) -> tuple[str, ServedModel]:
    """The model name a response carries and the served model that answers: ``model`` when
    the router serves it (a model or an adapter of one), the router's ``--model`` when
    absent; 404 naming those served otherwise."""
    try:
        served = models.resolve(model or "").served
    except ModelNotFoundError as exc:
        raise OpenAIError(
            HTTPStatus.NOT_FOUND, str(exc), param="model", code="model_not_found"
        ) from None
    return model or served.name, served


async def load_adapter(models: ServedModels, body: LoadLoraAdapterRequest) -> PlainTextResponse:
    """Load on every worker of its base model (``ServedModels.load_adapter``); vLLM's answer
    on success."""
    try:
        await models.load_adapter(body.lora_name, body.lora_path, body.base_model_name)
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
