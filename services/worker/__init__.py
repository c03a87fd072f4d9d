"""The runtime every worker shares: its config, the engine thread and loop, output streams,
prefix-cache event publishing, spans, and the process lifecycle (``runtime``)."""
