"""Moving paged KV blocks between engines: the backend contract and its implementations.

``kvtransfer.base`` defines the poll-based contract (``KVTransferBackend``) and
``kvtransfer.registry.make_backend(name)`` builds a backend by name:

- ``nixl`` (optional package): one-sided NIXL READs straight between CPU or CUDA caches;
- ``ucx`` (optional package): the pull protocol over UCX tagged messages, CPU caches;
- ``tcp``: the pull protocol over TCP sockets, CPU caches; pure Python, always available;
- ``inproc``: copies between engines of one process (tests, single-process demos).

Every backend is a ``kvtransfer.skeleton.BackendSkeleton``, which owns the bookkeeping (published
blocks, read states, releases, pairing and request checks) and leaves the transport to hooks.
``tcp`` and ``ucx`` share the pull protocol of ``kvtransfer._pull_protocol``.
"""
