"""Attention over the paged KV cache for one ragged batch of new tokens.

The batch is flattened to ``T`` tokens, single-token decodes first::

    | decode 0 | decode 1 | ... | prefill chunk A ......... | prefill chunk B .... |
    |<-- num_decode_tokens -->|  q_start(A)                  q_start(B)

Each layer first writes the new tokens' K/V into their cache slots, then
- decodes run either in the compiled CPU kernel (``cpu_kernels``: K/V read in place, online
  softmax in float32) or, as the reference path, as two batched matmuls over K/V gathered
  through padded block tables (the query heads sharing a KV head form the rows of one matmul,
  so GQA needs no K/V copy) with Hugging Face's eager score math (matmul, scale, mask, float32
  softmax);
- prefill chunks run either all at once in the compiled CPU kernel (``cpu_kernels``:
  each chunk's whole context read in place, causal and sliding-window masks computed inside) or
  one by one through SDPA (FlashAttention on CUDA) over their own context: the new tokens alone
  with ``is_causal`` when nothing was cached before them, else cached + new tokens with an
  explicit bottom-right causal mask.

Over an 8-bit cache (``kv_quant``) writes quantize; decodes run in the compiled 8-bit kernel
(scales folded in, the query rotated like int8 keys) or over dequantized gathers; prefill
chunks read their context dequantized (the compiled kernel from a per-layer scratch of the
step's blocks), a whole prompt included, so that every attention sees K/V as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kv_cache_spec import KV_SCALE_BYTES
from engine.model.kv_quant import KVQuant, dequantize_rows, key_rotation, quantize_rows
from engine.model.triton_inputs import TritonInputs

# torch's CPU flash attention runs a length that is not a multiple of 16 up to 2x slower than
# the next multiple (a 333-token prompt: 0.86 ms a layer, 352 tokens: 0.40 ms; bf16 at amx).
_CPU_SDPA_ROWS = 16


class PagedKVCache:
    """Layer-indexed reads and writes of the engine's KV tensor.

    The tensor is ``[num_blocks, num_layers, 2, num_kv_heads, block_size, row]``: a block is
    contiguous across layers (one transfer descriptor), and inside a layer the tokens of one
    KV head are contiguous, so a gather of whole ``[block_size, row]`` tiles yields
    ``[seqs, kv_heads, tokens, row]`` without a transpose. A row is ``head_dim`` values, or
    with ``quant`` (an 8-bit cache, ``uint8``) ``head_dim`` codes and their scale
    (``kv_quant``): writes quantize, gathers dequantize to ``dtype``. Indices are precomputed
    once per step for layer 0 / keys and shifted by a constant per layer and for values.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        quant: KVQuant | None = None,
        dtype: torch.dtype | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        _, num_layers, _, num_kv_heads, block_size, row_size = kv_cache.shape
        self.tensor = kv_cache
        self.quant = quant
        self.dtype = dtype or kv_cache.dtype  # of what gathers return
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.head_dim = row_size - KV_SCALE_BYTES if quant is not None else row_size
        # Keys are stored multiplied by this (kv_quant.key_rotation), on the cache's device.
        rotation = key_rotation(quant, self.head_dim)
        self.key_rotation = None if rotation is None else rotation.to(kv_cache.device)
        # The compiled 8-bit writes and dequantization (csrc/kv_quant.cpp), else torch's.
        self.kernels = kernels if quant is not None else None
        self._slots = kv_cache.view(-1, row_size)  # one row per (block, layer, k|v, head, slot)
        self._tiles = kv_cache.view(-1, block_size, row_size)  # per (block, layer, k|v, head)

    def slot_rows(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """[T, KVH] rows of layer 0's key slots for tokens at (block, offset)."""
        heads = torch.arange(self.num_kv_heads, device=block_ids.device) * self.block_size
        per_block = self.num_layers * 2 * self.num_kv_heads * self.block_size
        return (block_ids * per_block + offsets)[:, None] + heads[None, :]

    def tile_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        """[B, KVH, num_blocks] rows of layer 0's key tiles for block tables [B, num_blocks]."""
        heads = torch.arange(self.num_kv_heads, device=block_tables.device)
        per_block = self.num_layers * 2 * self.num_kv_heads
        return block_tables[:, None, :] * per_block + heads[None, :, None]

    def write(self, layer: int, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' ``k``/``v`` [T, KVH, D] at ``slot_rows`` (from ``slot_rows``)."""
        if self.kernels is not None:
            assert self.quant is not None
            self.kernels.kv_write_quantized(
                self.tensor,
                slot_rows,
                k.contiguous(),
                v.contiguous(),
                layer,
                self.quant.kernel_id,
                self.key_rotation is not None,
            )
            return
        key_rows = (slot_rows + layer * 2 * self.num_kv_heads * self.block_size).flatten()
        value_rows = key_rows + self.num_kv_heads * self.block_size
        if self.key_rotation is not None:
            k = k.float() @ self.key_rotation
        if self.quant is not None:
            k, v = quantize_rows(k, self.quant), quantize_rows(v, self.quant)
        self._slots.index_copy_(0, key_rows, k.reshape(len(key_rows), -1))
        self._slots.index_copy_(0, value_rows, v.reshape(len(value_rows), -1))

    def gather(self, layer: int, tile_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, KVH, num_blocks * block_size, D] of ``tile_rows`` [B, KVH, nb]."""
        b, kvh, nb = tile_rows.shape
        if self.kernels is not None:
            return self._gather_compiled(layer, tile_rows)
        key_rows = (tile_rows + layer * 2 * kvh).flatten()
        shape = (b, kvh, nb * self.block_size, self._tiles.shape[-1])
        keys = self._tiles.index_select(0, key_rows).view(shape)
        values = self._tiles.index_select(0, key_rows + kvh).view(shape)
        if self.quant is not None:
            keys = self._dequantize_keys(keys)
            values = dequantize_rows(values, self.quant, self.dtype)
        return keys, values

    def _gather_compiled(
        self, layer: int, tile_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # 8-bit rows widened by the compiled kernel (0.35 s against torch's 0.47 s over the
        # offline benchmark's prompts), then moved into gather's [B, KVH, tokens, D] order.
        b, kvh, nb = tile_rows.shape
        block_ids = (tile_rows[:, 0] // (self.num_layers * 2 * kvh)).flatten()
        kv = self.dequantized_layer(layer, block_ids)  # [b * nb, 1, 2, KVH, BS, D]
        kv = kv.view(b, nb, 2, kvh, self.block_size, self.head_dim).permute(2, 0, 3, 1, 4, 5)
        kv = kv.reshape(2, b, kvh, nb * self.block_size, self.head_dim)
        return kv[0], kv[1]

    def _dequantize_keys(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.quant is not None
        if self.key_rotation is None:
            return dequantize_rows(rows, self.quant, self.dtype)
        return (dequantize_rows(rows, self.quant, torch.float32) @ self.key_rotation).to(self.dtype)

    def dequantized_layer(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """``[len(block_ids), 1, 2, KVH, block_size, D]`` in ``dtype``: one layer of the given
        blocks, dequantized, in the cache's layout (a scratch cache for the prefill kernel)."""
        assert self.quant is not None
        if self.kernels is not None:
            shape = (len(block_ids), 1, 2, self.num_kv_heads, self.block_size, self.head_dim)
            out = torch.empty(shape, dtype=self.dtype)
            self.kernels.dequantize_kv_blocks(
                self.tensor,
                block_ids,
                layer,
                self.quant.kernel_id,
                self.key_rotation is not None,
                out,
            )
            return out
        rows = self.tensor[block_ids, layer]  # [n, 2, KVH, BS, row]
        keys = self._dequantize_keys(rows[:, 0])
        values = dequantize_rows(rows[:, 1], self.quant, self.dtype)
        return torch.stack([keys, values], dim=1).unsqueeze(1)


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """A chunk of ``q_len`` new tokens whose context holds ``num_context_tokens`` tokens."""

    q_start: int
    q_len: int
    num_context_tokens: int
    tile_rows: torch.Tensor  # [1, KVH, ceil(num_context_tokens / block_size)]
    mask: torch.Tensor | None  # [q_len, num_context_tokens] bool, True = attend; None = causal


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Every prefill chunk of a step, in the form the compiled prefill kernel reads.

    Chunk ``s`` is rows ``[q_starts[s], q_starts[s] + q_lens[s])`` of the step's tokens: the
    last ``q_lens[s]`` of its ``context_lens[s]`` context tokens, whose K/V are in the cache.
    """

    block_tables: torch.Tensor  # [S, max_blocks] long, padded with block 0
    q_starts: torch.Tensor  # [S] long
    q_lens: torch.Tensor  # [S] long
    context_lens: torch.Tensor  # [S] long
    kernel: ModuleType
    sliding_window: int | None
    # 8-bit cache: the blocks the chunks read; ``block_tables`` index into this list, and each
    # layer runs over these blocks dequantized (``PagedKVCache.dequantized_layer``).
    context_blocks: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """The decode rows of a step, in the form the selected decode backend reads."""

    block_tables: torch.Tensor  # [B, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [B] long
    tile_rows: torch.Tensor | None  # torch path: [B, KVH, max_blocks]
    bias: torch.Tensor | None  # torch path: [B, 1, 1, max_blocks * block_size], 0 | -inf
    kernel: ModuleType | None  # compiled CPU kernel (``cpu_kernels``), else the torch path
    sliding_window: int | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step inputs shared by every layer."""

    slot_rows: torch.Tensor  # [T, KVH] cache rows of the new tokens (layer 0, keys)
    num_decode_tokens: int
    decode: DecodeInputs
    prefills: tuple[PrefillSeq, ...]  # the SDPA path's chunks
    prefill_batch: PrefillBatch | None  # the compiled kernel's chunks (then ``prefills`` is empty)
    cos: torch.Tensor  # [T, 1, D] rotary tables at the tokens' positions (see RotaryEmbedding)
    sin: torch.Tensor
    # The Triton kernels' inputs (GPUs): then they compute every attention of the step, and
    # ``decode`` and ``prefills`` / ``prefill_batch`` are left empty (``for_triton``).
    triton: TritonInputs | None = None

    @classmethod
    def for_triton(
        cls,
        slot_rows: torch.Tensor,
        num_decode_tokens: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        triton: TritonInputs,
    ) -> AttentionMetadata:
        """A step whose every attention runs the Triton path."""
        empty = torch.empty(0, dtype=torch.long, device=slot_rows.device)
        unused = DecodeInputs(empty, empty, None, None, None, triton.sliding_window)
        return cls(slot_rows, num_decode_tokens, unused, (), None, cos, sin, triton)


def causal_mask(
    q_len: int, num_context_tokens: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Bottom-right aligned causal mask, or None when plain ``is_causal`` is equivalent."""
    if q_len == num_context_tokens and (sliding_window is None or sliding_window >= q_len):
        return None
    q_pos = torch.arange(num_context_tokens - q_len, num_context_tokens, device=device)[:, None]
    k_pos = torch.arange(num_context_tokens, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def decode_bias(
    context_lens: torch.Tensor, max_len: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """[B, 1, 1, max_len] additive mask: 0 on each decode query's valid (in-window) context."""
    k_pos = torch.arange(max_len, device=context_lens.device)[None, :]
    lens = context_lens[:, None]
    valid = k_pos < lens
    if sliding_window is not None:
        valid &= (lens - 1) - k_pos < sliding_window
    bias = torch.zeros(valid.shape, dtype=dtype, device=context_lens.device)
    return bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Attention output [T, H, D] for queries ``q`` [T, H, D] and new ``k``/``v`` [T, KVH, D].

    Side effect: writes ``k``/``v`` into the cache at the tokens' slots.
    """
    if meta.triton is not None:
        from engine.model.triton_attention import triton_paged_attention

        return triton_paged_attention(
            layer,
            q,
            k,
            v,
            cache.tensor,
            cache.quant,
            cache.key_rotation,
            meta.slot_rows,
            meta.num_decode_tokens,
            meta.triton,
        )
    cache.write(layer, meta.slot_rows, k, v)
    num_decode = meta.num_decode_tokens
    batch = meta.prefill_batch
    if not meta.prefills and batch is None:
        return _decode(layer, q, cache, meta)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = _decode(layer, q[:num_decode], cache, meta)
    if batch is not None:
        context, context_layer = cache.tensor, layer
        if batch.context_blocks is not None:
            context, context_layer = cache.dequantized_layer(layer, batch.context_blocks), 0
        batch.kernel.paged_prefill(
            q,
            context,
            batch.block_tables,
            batch.q_starts,
            batch.q_lens,
            batch.context_lens,
            context_layer,
            q.shape[-1] ** -0.5,
            batch.sliding_window or -1,
            out,
        )
    for seq in meta.prefills:
        out[seq.q_start : seq.q_start + seq.q_len] = _prefill(layer, q, k, v, cache, seq)
    return out


def _decode(
    layer: int, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata
) -> torch.Tensor:
    inputs = meta.decode
    num_seqs, num_heads, head_dim = q.shape
    if inputs.kernel is not None:
        args = (
            cache.tensor,
            inputs.block_tables,
            inputs.context_lens,
            layer,
            head_dim**-0.5,
            inputs.sliding_window or -1,
        )
        if cache.quant is None:
            return inputs.kernel.paged_decode(q.contiguous(), *args)
        # Rotated keys take a rotated query (kv_quant): the kernel rotates it.
        rotate = cache.key_rotation is not None
        return inputs.kernel.paged_decode_quantized(
            q.contiguous(), *args, cache.quant.kernel_id, rotate
        )
    group = num_heads // cache.num_kv_heads
    assert inputs.tile_rows is not None and inputs.bias is not None  # built for the torch path
    keys, values = cache.gather(layer, inputs.tile_rows)  # [B, KVH, L, D]
    qg = q.view(num_seqs, cache.num_kv_heads, group, head_dim)  # [B, KVH, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(head_dim**-0.5)
    scores.add_(inputs.bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).view(num_seqs, num_heads, head_dim)


def _prefill(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    seq: PrefillSeq,
) -> torch.Tensor:
    end = seq.q_start + seq.q_len
    qs = q[seq.q_start : end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    # A whole prompt attends to its own new K/V, except over an 8-bit cache: there every
    # attention reads K/V as stored, so that a prefix hit and a recomputation agree.
    if seq.num_context_tokens == seq.q_len and cache.quant is None:
        keys = k[seq.q_start : end].transpose(0, 1).unsqueeze(0)  # [1, KVH, q_len, D]
        values = v[seq.q_start : end].transpose(0, 1).unsqueeze(0)
    else:
        keys, values = cache.gather(layer, seq.tile_rows)
        keys = keys[:, :, : seq.num_context_tokens]
        values = values[:, :, : seq.num_context_tokens]
    out = _sdpa(qs, keys, values, seq.mask)
    return out[0, :, : seq.q_len].transpose(0, 1)


def _sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA of ``q`` [1, H, q_len, D] over ``keys``/``values`` [1, KVH, ctx, D], bottom-right
    causal (``mask`` None: ``q_len == ctx``); on CPU with both lengths zero-padded to a multiple
    of ``_CPU_SDPA_ROWS``. Returns [1, H, >= q_len, D]: rows past ``q_len`` are padding.

    Padding leaves the real rows' result as it was: padded keys come after every real query's
    last allowed key (``is_causal``) or are masked out, and padded query rows are dropped.
    """
    pad_q, pad_k = -q.shape[2] % _CPU_SDPA_ROWS, -keys.shape[2] % _CPU_SDPA_ROWS
    if q.device.type == "cpu" and (pad_q or pad_k):
        q = F.pad(q, (0, 0, 0, pad_q))
        keys, values = F.pad(keys, (0, 0, 0, pad_k)), F.pad(values, (0, 0, 0, pad_k))
        if mask is not None:
            mask = F.pad(mask, (0, pad_k, 0, pad_q), value=False)
            mask[mask.shape[0] - pad_q :, 0] = True  # padded rows attend something: no NaN
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
