"""``build_engine``: the engine ``--engine`` names, behind ``EngineBackend``."""

from __future__ import annotations

from engine.backend import EngineBackend
from engine.config import EngineConfig, EngineKind
from engine.llm_engine import LLMEngine


def build_engine(config: EngineConfig) -> EngineBackend:
    """Load ``config``'s model on the engine it names: this repository's (``native``, and
    ``mock`` behind the same scheduler) or vLLM's, imported only when asked for."""
    if config.engine is EngineKind.VLLM:
        from engine.vllm_engine.engine import VLLMEngine

        return VLLMEngine(config)
    return LLMEngine(config)
