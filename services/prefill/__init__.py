"""The prefill worker: computes prompts' KV, samples the first token, leases the blocks."""
