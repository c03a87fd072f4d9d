"""``--engine vllm``: vLLM's engine core behind ``EngineBackend`` (engine.py), its flags
(args.py), request and output conversion (convert.py) and prefix-cache events (events.py).
vLLM is an optional dependency: nothing here imports it at module level."""
