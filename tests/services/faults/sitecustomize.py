"""Fault injection for the worker processes of a test (this directory goes on PYTHONPATH).

``SPLITSERVE_TEST_ENGINE_FAULT=<token id>:<marker path>``: the first engine to hold a request
with that token, and only that one (it creates the marker file), dies in its next step as if
its device had failed: ``LLMEngine.step`` raises, outside the per-request isolation.
"""

from __future__ import annotations

import os

_FAULT = os.environ.get("SPLITSERVE_TEST_ENGINE_FAULT")

if _FAULT:
    from pathlib import Path

    from engine.batch_runner import EngineBrokenError
    from engine.llm_engine import LLMEngine

    _token_text, _marker_text = _FAULT.split(":", 1)
    _token_id, _marker = int(_token_text), Path(_marker_text)
    _step = LLMEngine.step

    def _step_with_fault(self: LLMEngine) -> list:
        holds_token = any(
            _token_id in request.all_token_ids for request in self.scheduler.requests.values()
        )
        if holds_token and not _marker.exists():
            _marker.write_text(str(os.getpid()))
            raise EngineBrokenError("injected device fault")
        return _step(self)

    LLMEngine.step = _step_with_fault  # type: ignore[method-assign]
