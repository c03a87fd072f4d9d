"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Numerics follow Hugging Face's implementation op for op (RMSNorm in float32, rotary tables in
float32 cast to the model dtype, residual order), so greedy decoding matches it token for
token. q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import AttentionMetadata, PagedKVCache, paged_attention
from engine.model.config import ModelConfig
from engine.model.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm bit for bit: normalize in float32, round, then scale.

    (``F.rms_norm`` straight on bfloat16 is both slower on CPU and rounds differently.)
    """
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
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
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], meta.cos, meta.sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = paged_attention(self.layer, q, k, v, cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.empty(config.hidden_size))
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)

    def forward(
        self, hidden: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        attn_in = rms_norm(hidden, self.input_layernorm, self.eps)
        hidden = hidden + self.self_attn(attn_in, meta, cache)
        mlp_in = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        return hidden + self.mlp(mlp_in)


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
        self.model = LlamaModel(config)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the batch's new tokens; fills their KV slots."""
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, meta, cache)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected rows of the final hidden states."""
        normed = rms_norm(hidden, self.model.norm, self.config.rms_norm_eps)
        return F.linear(normed, self.lm_head.weight).float()
