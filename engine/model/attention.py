"""Attention over the paged KV cache for one ragged batch of new tokens.

The batch is flattened to ``T`` tokens, single-token decodes first::

    | decode 0 | decode 1 | ... | prefill chunk A ......... | prefill chunk B .... |
    |<-- num_decode_tokens -->|  q_start(A)                  q_start(B)

Each layer first writes the new tokens' K/V into their cache slots, then
- decodes run as one batched SDPA over K/V gathered through padded block tables (the query
  heads sharing a KV head are folded into the query-length axis, so GQA needs no K/V copy);
- each prefill chunk runs SDPA (FlashAttention on CUDA) over its own context: the new tokens
  alone with ``is_causal`` when nothing was cached before them, else cached + new tokens with an
  explicit bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """A chunk of ``q_len`` new tokens whose context holds ``num_context_tokens`` tokens."""

    q_start: int
    q_len: int
    num_context_tokens: int
    block_ids: torch.Tensor  # [ceil(num_context_tokens / block_size)] long
    mask: torch.Tensor | None  # [q_len, num_context_tokens] bool, True = attend; None = causal


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step inputs shared by every layer."""

    slot_block_ids: torch.Tensor  # [T] long: cache block of each new token
    slot_offsets: torch.Tensor  # [T] long: position inside that block
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks] long (padded)
    decode_mask: torch.Tensor  # [num_decode_tokens, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillSeq, ...]


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


def decode_mask(
    context_lens: torch.Tensor, max_len: int, sliding_window: int | None
) -> torch.Tensor:
    """[B, 1, 1, max_len] mask of the valid (and in-window) context of each decode query."""
    k_pos = torch.arange(max_len, device=context_lens.device)[None, :]
    lens = context_lens[:, None]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= (lens - 1) - k_pos < sliding_window
    return mask[:, None, None, :]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Attention output [T, H, D] for queries ``q`` [T, H, D] and new ``k``/``v`` [T, KVH, D].

    Side effect: writes ``k``/``v`` into ``key_cache``/``value_cache`` ([num_blocks, block_size,
    KVH, D] per-layer views of the engine's cache) at the tokens' slots.
    """
    key_cache[meta.slot_block_ids, meta.slot_offsets] = k
    value_cache[meta.slot_block_ids, meta.slot_offsets] = v
    num_decode = meta.num_decode_tokens
    if num_decode == q.shape[0] and not meta.prefills:
        return _decode(q, key_cache, value_cache, meta)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = _decode(q[:num_decode], key_cache, value_cache, meta)
    for seq in meta.prefills:
        end = seq.q_start + seq.q_len
        out[seq.q_start : end] = _prefill(q, k, v, key_cache, value_cache, seq)
    return out


def _decode(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    # [B, KVH, G, D]: the G query heads of one KV head act as G query positions.
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    keys = key_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)  # [B, KVH, L, D]
    values = value_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq: PrefillSeq,
) -> torch.Tensor:
    end = seq.q_start + seq.q_len
    qs = q[seq.q_start : end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    if seq.num_context_tokens == seq.q_len:
        keys, values = k[seq.q_start : end], v[seq.q_start : end]
    else:
        keys = key_cache[seq.block_ids].flatten(0, 1)[: seq.num_context_tokens]
        values = value_cache[seq.block_ids].flatten(0, 1)[: seq.num_context_tokens]
    out = F.scaled_dot_product_attention(
        qs,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
