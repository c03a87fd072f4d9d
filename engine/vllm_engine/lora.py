"""LoRA adapters on a vLLM engine through splitserve's API (``EngineBackend``'s adapter calls).

vLLM serves them (its ``--enable-lora``: splitserve's ``--enable-lora``, ``--max-loras`` and
``--max-lora-rank`` are passed on); this registry names each to vLLM by its **block key**
(``name@`` and the weights' sha256, as the native engine keys its blocks), not by its name. So
vLLM's own prefix cache, which keys blocks by the adapter's name, never serves a block computed
with other weights loaded earlier under the same name, and its KV events name the block key the
router's hashes use (``events.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from engine.lora.adapter import adapter_block_key, weights_fingerprint
from engine.lora.names import check_adapter_name

logger = logging.getLogger(__name__)


class VLLMLoras:
    """The adapters one vLLM engine core serves, by the names clients use.

    Invariant: a name is here exactly while vLLM holds its adapter (``add_lora`` succeeded and
    no ``remove_lora`` since). At most ``max_cpu_loras`` are loaded (vLLM would otherwise
    evict the least recently used one from its memory and reload it from disk at its next
    request); any of them can run in any step up to ``max_loras`` per batch. Engine thread only.
    """

    def __init__(self, core: Any, lora_config: Any | None) -> None:
        self._core = core
        self._max_loaded = 0 if lora_config is None else int(lora_config.max_cpu_loras)
        self._requests: dict[str, Any] = {}  # name -> vLLM LoRARequest
        self._next_id = 1  # vLLM's adapter ids: never reused, so no step mixes two weights

    @property
    def block_keys(self) -> dict[str, str]:
        """Loaded adapters, in load order, with their block keys: a copy."""
        return {name: request.lora_name for name, request in self._requests.items()}

    def load(self, name: str, path: str) -> None:
        """Have vLLM serve the PEFT adapter at ``path`` as ``name``; ``ValueError`` saying why
        not (LoRA off, the name taken, every slot used, vLLM's reason for the files)."""
        from vllm.lora.request import LoRARequest

        if not self._max_loaded:
            raise ValueError("LoRA adapters need --enable-lora")
        check_adapter_name(name)
        if name in self._requests:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if len(self._requests) >= self._max_loaded:
            raise ValueError(
                f"LoRA adapter {name!r}: {self._max_loaded} adapters are loaded "
                f"({', '.join(self._requests)}); unload one first"
            )
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
        logger.info("LoRA adapter %s loaded into vLLM from %s", name, path)

    def unload(self, name: str, in_flight: Iterable[str]) -> None:
        """Stop serving ``name``; ``ValueError`` if it is not loaded or a request in flight
        (``in_flight``: their adapters' names) uses it."""
        request = self.request(name)
        in_use = sum(lora_name == name for lora_name in in_flight)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} requests")
        self._core.remove_lora(request.lora_int_id)
        del self._requests[name]
        logger.info("LoRA adapter %s unloaded from vLLM", name)

    def request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` of loaded adapter ``name``; ``ValueError`` naming it else."""
        request = self._requests.get(name)
        if request is None:
            loaded = ", ".join(self._requests) or "none"
            raise ValueError(f"lora_name: no LoRA adapter {name!r} is loaded (loaded: {loaded})")
        return request
