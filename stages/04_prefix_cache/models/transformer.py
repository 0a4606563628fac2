"""One decoder-only transformer that covers Qwen3, Qwen3-MoE and Llama.

The architectures differ in two switches: Qwen3 normalises q and k per head
(`qk_norm`), and some checkpoints add a bias to q/k/v (`attention_bias`). Qwen3-MoE is
Qwen3 with a mixture of experts in place of the MLP (SparseMoeBlock) in the layers that
config.json makes sparse."""

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention
from ..layers.embedding import Embedding, LMHead
from ..layers.linear import Linear, MergedLinear, QKVLinear
from ..layers.moe import Experts, route
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool, max_positions: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, self.num_heads, self.num_kv_heads, cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (tokens, heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)  # (tokens, heads, head_dim)
        return self.o_proj(o.flatten(1))  # (tokens, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # (tokens, hidden)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MLP: the router (`gate`) scores every expert for each token, the token goes
    to its `num_experts_per_tok` best, and their outputs are summed with the routing weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # (tokens, experts)
        weights, expert_ids = route(router_logits, self.top_k, self.renormalize)  # (tokens, top_k) each
        return self.experts(x, weights, expert_ids)  # (tokens, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool, max_positions: int, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(cfg, qk_norm, max_positions)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        # pre-norm block; `residual` carries the stream, the fused norm adds it back in
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual  # (tokens, hidden) each


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool, max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, qk_norm, max_positions, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward(input_ids, positions)` -> hidden states (tokens, hidden);
    `compute_logits(hidden)` -> (rows, vocab)."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool, max_positions: int):
        super().__init__()
        self.model = Model(cfg, qk_norm, max_positions)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (tokens, hidden)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.model.norm(x, residual)
        return x  # (tokens, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # (rows, vocab)
