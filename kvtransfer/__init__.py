"""Moving paged KV blocks between engines: the backend interface and its implementations.

``kvtransfer.base`` defines the poll-based contract; ``kvtransfer.registry.make_backend(name)``
builds one (``tcp`` always, ``inproc`` for tests; ``nixl`` comes with its own issue).
"""
