"""The router: the client-facing gRPC front end that drives prefill and decode workers.

Torch-free: it tokenizes, detokenizes and routes, but never runs the model.
"""
