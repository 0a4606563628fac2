"""One decoder-only transformer that covers Qwen3, Qwen3-MoE, Qwen2 and Llama.

The families differ in three switches (models/__init__.py sets them): Qwen3 normalises
q and k per head (`qk_norm`), Qwen2 adds a bias to q, k and v (`qkv_bias`), and some
checkpoints add one to o_proj too (`o_bias`). Qwen3-MoE puts a mixture of experts
(SparseMoeBlock) in place of the MLP in the layers config.json makes sparse. Every layer
holds this rank's shard of the weights (layers/linear.py, layers/moe.py); QKVParallelLinear
says how many heads that is."""

import torch
from torch import nn

from ..model_config import ModelConfig
from ..kernels import dispatch
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import Linear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.moe import Experts, route
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, qk_norm: bool, qkv_bias: bool, o_bias: bool):
        super().__init__()
        # q/k/v are split across the ranks by heads, o_proj by its inputs
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, qkv_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, o_bias)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (tokens, heads / tp, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (tokens, kv_heads / tp, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # RoPE (Qwen3: after a per-head RMSNorm of q and k), the cache store and the attention
        o = self.attn(positions, q, k, v, self.rotary_emb, self.q_norm, self.k_norm)  # (tokens, heads / tp, head_dim)
        return self.o_proj(o.flatten(1))  # (tokens, hidden), summed over the ranks


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # each rank holds intermediate / tp of the gate, up and down weights
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, gemv_kind="gate_up")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, gemv_kind="down")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.takes_gemv(x, "gate_up"):
            # a few rows (a small decode batch, a verify step): the activation on the weight tiles
            h = dispatch.gemv.dense_gate_up(x, self.gate_up_proj.weight)
        else:
            h = self.act(self.gate_up_proj(x))
        return self.down_proj(h)  # (tokens, intermediate / tp) -> (tokens, hidden)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)  # the router, replicated on every rank
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)  # (tokens, top_k) each
        return self.experts(x, weights, expert_ids)  # (tokens, hidden), summed over the ranks


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, layer: int, **switches):
        super().__init__()
        self.self_attn = SelfAttention(cfg, max_positions, **switches)
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
    def __init__(self, cfg: ModelConfig, max_positions: int, **switches):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, max_positions, i, **switches) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward(input_ids, positions)` -> hidden states (tokens, hidden);
    `compute_logits(hidden)` -> (rows, vocab) on rank 0, None on the other ranks."""

    def __init__(self, cfg: ModelConfig, max_positions: int, *, qk_norm: bool, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.model = Model(cfg, max_positions, qk_norm=qk_norm, qkv_bias=qkv_bias, o_bias=o_bias)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (tokens, hidden)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.model.norm(x, residual)
        return x  # (tokens, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)  # (rows, vocab) on rank 0; None on the other ranks
