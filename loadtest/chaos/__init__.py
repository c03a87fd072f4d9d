"""The chaos harness (``python -m loadtest.chaos``): kills, stops and link cuts on a live
cluster (``matrix``, ``faults``), and hostile clients against it (``hostile``)."""
