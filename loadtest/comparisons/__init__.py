"""The headline comparisons (``experiments``) and the comparison against ``vllm serve``
(``vs_vllm``), each arm a fresh local cluster."""
