"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Numerics follow Hugging Face's implementation op for op (RMSNorm in float32, rotary tables in
float32 cast to the model dtype, residual order), so greedy decoding matches it token for
token. q/k/v and gate/up projections are fused into one matmul each. The residual stream is
one tensor updated in place: each layer's MLP output is added by the next layer's first norm
(fused there when the ops are ``FusedCpuOps``), and the last one by ``forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import AttentionMetadata, PagedKVCache, paged_attention
from engine.model.config import ModelConfig
from engine.model.ops import TorchOps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ops = TorchOps()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self, hidden: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        # q and k heads are adjacent: rotate them in one pass.
        self.ops.rotary_(qkv, meta.cos, meta.sin, self.num_heads + self.num_kv_heads)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        out = paged_attention(self.layer, q, k, v, cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ops = TorchOps()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ops = TorchOps()
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.empty(config.hidden_size))
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)

    def forward(
        self,
        residual: torch.Tensor,
        pending: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """Add ``pending`` (the previous layer's MLP output, if any) and this layer's attention
        output to ``residual`` in place; return this layer's MLP output, still to be added."""
        if pending is None:
            attn_in = self.ops.rms_norm(residual, self.input_layernorm, self.eps)
        else:
            attn_in = self.ops.add_rms_norm(residual, pending, self.input_layernorm, self.eps)
        attn_out = self.self_attn(attn_in, meta, cache)
        mlp_in = self.ops.add_rms_norm(residual, attn_out, self.post_attention_layernorm, self.eps)
        return self.mlp(mlp_in)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size))


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Parameter names mirror Hugging Face's (fused where noted)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.ops = TorchOps()
        self.model = LlamaModel(config)
        self.lm_head: nn.Embedding | nn.Linear
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A faster equivalent of the LM head matmul (``packed_linear.pack_lm_head``), if set.
        self.logits_proj: nn.Module | None = None

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the batch's new tokens; fills their KV slots."""
        residual = self.model.embed_tokens(input_ids)
        pending = None
        for layer in self.model.layers:
            pending = layer(residual, pending, meta, cache)
        return residual if pending is None else residual.add_(pending)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in the model's dtype for the selected rows of the final hidden
        states: the LM head's output as it is, so that a greedy batch takes its argmax without
        widening 49,152 values a row to float32 (the sampler widens the rows that need it)."""
        normed = self.ops.rms_norm(hidden, self.model.norm, self.config.rms_norm_eps)
        if self.logits_proj is not None:
            return self.logits_proj(normed)
        return F.linear(normed, self.lm_head.weight)

    def use_ops(self, ops: TorchOps) -> None:
        """Run every elementwise op of the model through ``ops`` from now on."""
        for module in self.modules():
            if isinstance(module, (LlamaForCausalLM, DecoderLayer, Attention, MLP)):
                module.ops = ops
