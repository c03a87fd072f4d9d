"""The adapters one engine serves, by name, and the block key each puts into its hashes."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

logger = logging.getLogger(__name__)


class AdapterLoader(Protocol):
    """What installs adapters: the native engine's model executor, or vLLM's engine core
    (``engine.vllm_engine.lora``). ``load_lora_adapter`` returns the adapter's block key."""

    def load_lora_adapter(self, name: str, path: str) -> str: ...

    def unload_lora_adapter(self, name: str) -> None: ...


class LoraRegistry:
    """Loaded adapters: ``name -> block key`` (see ``LoraAdapter.block_key``).

    Invariant: a name is here exactly while the executor serves it. Engine thread only.
    """

    def __init__(self, loader: AdapterLoader, enabled: bool, max_loras: int) -> None:
        self._loader = loader
        self._enabled = enabled
        self._max_loras = max_loras
        self._keys: dict[str, str] = {}

    @property
    def block_keys(self) -> dict[str, str]:
        """Loaded adapters, in load order, with their block keys: a copy (any thread)."""
        return dict(self._keys)

    def load(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name``; ``ValueError`` saying why not
        (LoRA off, the name taken, every slot used, the files)."""
        if not self._enabled:
            raise ValueError("LoRA adapters need --enable-lora")
        if name in self._keys:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if len(self._keys) >= self._max_loras:
            raise ValueError(
                f"LoRA adapter {name!r}: --max-loras {self._max_loras} adapters are loaded "
                f"({', '.join(self._keys)}); unload one first"
            )
        self._keys[name] = self._loader.load_lora_adapter(name, path)
        logger.info("LoRA adapter %s loaded from %s", name, path)

    def unload(self, name: str, in_flight: Iterable[str] = ()) -> None:
        """Stop serving ``name``; ``ValueError`` if it is not loaded or a request in flight
        (``in_flight``: the adapter names of the engine's requests) uses it."""
        self.block_key(name)
        in_use = sum(lora_name == name for lora_name in in_flight)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} requests")
        self._loader.unload_lora_adapter(name)
        del self._keys[name]
        logger.info("LoRA adapter %s unloaded", name)

    def block_key(self, name: str) -> str:
        """The block key of loaded adapter ``name``; ``ValueError`` naming it otherwise."""
        key = self._keys.get(name)
        if key is None:
            loaded = ", ".join(self._keys) or "none"
            raise ValueError(f"lora_name: no LoRA adapter {name!r} is loaded (loaded: {loaded})")
        return key
