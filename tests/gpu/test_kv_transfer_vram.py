"""nixl with the KV caches in VRAM (registration as VRAM, UCX's CUDA transports) between two
processes: bit-exact reordered blocks and a refused read. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.base import KVRef
from kvtransfer.registry import is_available
from tests.kvtransfer.harness import (
    BIG_SPEC,
    DONE,
    FAILED,
    NUM_BLOCKS,
    SourceProcess,
    make_cache,
    make_dst,
    read,
    rows,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not is_available("nixl"), reason="needs the nixl package"),
]


def test_vram_to_vram_read_is_bit_exact():
    source = SourceProcess("nixl", [("gpu-src", BIG_SPEC, 7)], device="cuda")
    dst, dst_cache = make_dst("nixl", BIG_SPEC, engine_id="gpu-dst", device="cuda")
    try:
        info = source.info("gpu-src")
        dst.add_peer(info)
        src_ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(4)).tolist()
        grant = source.publish("gpu-src", "whole", src_ids)
        src = KVRef("gpu-src", "whole", tuple(src_ids), NUM_BLOCKS * 16, grant)
        assert read(dst, "whole", src, list(range(NUM_BLOCKS))) is DONE
        expected = rows(make_cache(BIG_SPEC, seed=7))[src_ids]
        assert torch.equal(rows(dst_cache).cpu(), expected)
        assert read(dst, "refused", KVRef("gpu-src", "never", (1,), 16), [1]) is FAILED
    finally:
        dst.close()
        source.stop()
