"""LoRA adapters on a vLLM engine through splitserve's API (``EngineBackend``'s adapter calls).

vLLM serves them (its ``--enable-lora``: splitserve's ``--enable-lora``, ``--max-loras`` and
``--max-lora-rank`` are passed on); ``VLLMAdapterLoader`` installs them into vLLM's engine core
behind the same ``LoraRegistry`` as the native engine's, and names each to vLLM by its **block
key** (``name@`` and the weights' sha256, as the native engine keys its blocks), not by its
name. So vLLM's own prefix cache, which keys blocks by the adapter's name, never serves a block
computed with other weights loaded earlier under the same name, and its KV events name the
block key the router's hashes use (``events.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.lora.adapter import adapter_block_key, weights_fingerprint
from engine.lora.names import check_adapter_name

logger = logging.getLogger(__name__)


class VLLMAdapterLoader:
    """``AdapterLoader`` over one vLLM engine core: each loaded adapter's ``LoRARequest``, by
    the name clients use. Engine thread only."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._requests: dict[str, Any] = {}  # name -> vLLM LoRARequest
        self._next_id = 1  # vLLM's adapter ids: never reused, so no step mixes two weights

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Have vLLM serve the PEFT adapter at ``path`` as ``name``; its block key.
        ``ValueError`` with vLLM's reason when it cannot."""
        from vllm.lora.request import LoRARequest

        check_adapter_name(name)
        request = LoRARequest(
            adapter_block_key(name, weights_fingerprint(path)), self._next_id, str(path)
        )
        self._next_id += 1
        try:
            added = self._core.add_lora(request)
        except (ValueError, RuntimeError, OSError, KeyError) as exc:
            raise ValueError(f"LoRA adapter {name!r}: vLLM cannot load it: {exc}") from None
        if not added:
            raise ValueError(f"LoRA adapter {name!r}: vLLM did not load it (see the log)")
        self._requests[name] = request
        return str(request.lora_name)

    def unload_lora_adapter(self, name: str) -> None:
        self._core.remove_lora(self._requests.pop(name).lora_int_id)

    def request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` of loaded adapter ``name`` (the registry checked the name)."""
        return self._requests[name]
