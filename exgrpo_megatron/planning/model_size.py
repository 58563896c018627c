"""The size of the model a `ModelConfig` builds: its parameters (whole; per rank: planning/sharding.py) and its KV
cache per token. Pure functions of the config (the dry run's memory plan and the vLLM start-up check use them)."""

from __future__ import annotations

from dataclasses import dataclass

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the GPT model megatron builds from a `ModelConfig` (padded vocabulary)."""

    embedding: int
    output_layer: int  # 0 when the word embeddings are tied
    per_layer_sharded: int  # QKV (+bias), o_proj, fc1 (gate+up), fc2: split over TP
    per_layer_replicated: int  # the two RMSNorm weights (+ the QK-norms, the MoE router): replicated over TP
    final_norm: int
    num_layers: int
    per_layer_experts: int = 0  # MoE: every expert's fc1 + fc2, split over EP x ETP (the dense fc1/fc2 are then 0)

    @property
    def total(self) -> int:
        layers = self.num_layers * (self.per_layer_sharded + self.per_layer_replicated + self.per_layer_experts)
        return self.embedding + self.output_layer + layers + self.final_norm


def count_parameters(m: ModelConfig, tp: int = 1) -> ParamCounts:
    """embedding V x h; per layer: QKV h x (q + 2kv) (+ q + 2kv bias if the family has it), o_proj q x h,
    SwiGLU fc1 h x 2f and fc2 f x h, two norms of h (+ q and k norms of d each with QK-norm); final norm h;
    output V x h unless tied. Mixture of experts: instead of fc1/fc2, E experts of h x 2f_e + f_e x h and a router
    of E x h."""
    family = family_of(m.family)
    d = head_dim(m)
    q_dim, kv_dim = m.num_attention_heads * d, m.num_query_groups * d
    h, f = m.hidden_size, m.ffn_hidden_size
    qkv = h * (q_dim + 2 * kv_dim) + ((q_dim + 2 * kv_dim) if family.qkv_bias else 0)
    moe = m.num_experts > 0
    sharded = qkv + q_dim * h + (0 if moe else h * 2 * f + f * h)
    fe = m.moe_ffn_hidden_size or f
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    return ParamCounts(
        embedding=vocab * h,
        output_layer=0 if m.tie_word_embeddings else vocab * h,
        per_layer_sharded=sharded,
        per_layer_replicated=2 * h + (2 * d if family.qk_norm else 0) + (m.num_experts * h if moe else 0),
        final_norm=h,
        num_layers=m.num_layers,
        per_layer_experts=m.num_experts * 3 * h * fe if moe else 0,
    )


def param_bytes(m: ModelConfig) -> int:
    return 4 if m.params_dtype == "fp32" else 2  # auto = bf16 on the GPU target


def kv_bytes_per_token(m: ModelConfig, tp: int, pp: int) -> int:
    """K and V of every layer on this rank: 2 x L/PP x max(G/TP, 1) x d x 2 B (bf16 cache)."""
    return 2 * (m.num_layers // pp) * max(m.num_query_groups // tp, 1) * head_dim(m) * 2
