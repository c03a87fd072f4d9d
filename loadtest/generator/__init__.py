"""The load generator: ``splitserve loadtest`` (``cli``), its sweeps, backends, workloads,
metrics and reports."""
