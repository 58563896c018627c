"""Build a megatron-core `GPTModel` from a `ModelConfig` and its family (config/families.py).

Every family is RMSNorm, SwiGLU, RoPE (theta from the preset), GQA, tied or untied embeddings; the family says
whether q/k/v carry a bias (Qwen2), whether queries and keys get a per-head RMSNorm before RoPE (Qwen3: megatron's
qk_layernorm, in both layer specs) and which RoPE scaling it may use (Llama 3.1: factor 8, low/high frequency
factors 1/4, original context 8192, as megatron-core implements it). The head dim is `kv_channels`, which may
differ from hidden / heads (Qwen3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exgrpo_megatron.config.derived import head_dim, padded_vocab_size, resolve_layer_spec, resolve_params_dtype
from exgrpo_megatron.config.families import family_of
from exgrpo_megatron.config.schema import LoraConfig, ModelConfig, ParallelConfig
from exgrpo_megatron.model.moe import is_moe, moe_transformer_config, per_micro_batch_router_losses

ACTIVATIONS = {"silu": F.silu}  # a family's activation -> the gated MLP's function


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = resolve_params_dtype(cfg)
    family = family_of(cfg.family)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=head_dim(cfg),
        normalization=family.normalization,
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[family.activation],
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        # Fusions off: they keep low-precision intermediates that widen the train/inference
        # log-prob mismatch (docs/precision.md), and they do not exist on CPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # The full master weight is built then split: TP-invariant initialisation.
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        batch_p2p_sync=torch.cuda.is_available(),
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity="full" if cfg.recompute_activations else None,
        recompute_method="uniform" if cfg.recompute_activations else None,
        recompute_num_layers=1 if cfg.recompute_activations else None,
        # Loss is a global token sum we normalise ourselves (algo/loss.py).
        calculate_per_token_loss=True,
        **moe_transformer_config(cfg, parallel),
    )


def layer_spec(cfg: ModelConfig, tcfg=None, vp_stage: int | None = None, lora: LoraConfig | None = None):
    """The decoder spec: TE's layer, or megatron's local layer with our CPU submodules (`model.core_attention`,
    `model.fused_norm_rope`; the latter also replaces the final norm, so it returns the whole block's spec for
    this pipeline stage, which needs the stage's `tcfg`), and LoRA's linears when `lora.rank` > 0 (model/lora.py)."""
    from megatron.core.models.gpt import gpt_layer_specs

    family = family_of(cfg.family)
    moe = {"num_experts": cfg.num_experts if is_moe(cfg) else None, "qk_layernorm": family.qk_norm}
    adapted = lora is not None and lora.rank > 0
    if resolve_layer_spec(cfg) == "te":
        if adapted:
            raise ValueError("lora.rank > 0 adapts the local layer spec's linears: set model.layer_spec=local")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=cfg.moe_grouped_gemm, **moe)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=family.normalization, **moe)
    if cfg.core_attention == "sdpa":
        from exgrpo_megatron.model.sdpa_attention import SDPADotProductAttention

        spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    if lora is not None and adapted:
        from exgrpo_megatron.model.lora import add_lora_to_spec

        add_lora_to_spec(spec, lora)
    if not cfg.fused_norm_rope:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from exgrpo_megatron.model.fused_ops import FusedRMSNorm, FusedRopeSelfAttention

    spec.submodules.input_layernorm = FusedRMSNorm
    spec.submodules.pre_mlp_layernorm = FusedRMSNorm
    if family.qk_norm:
        spec.submodules.self_attention.submodules.q_layernorm = FusedRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = FusedRMSNorm
    spec.submodules.self_attention.module = FusedRopeSelfAttention
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tcfg, vp_stage),
                                      layer_norm=FusedRMSNorm)


def build_gpt_model(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    lora: LoraConfig | None = None,
):
    """One pipeline stage of the policy on this rank (parallel state must be initialised); `lora`: its adapters."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tcfg = transformer_config(cfg, parallel)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec(cfg, tcfg, vp_stage, lora),
        vocab_size=padded_vocab_size(
            cfg.vocab_size, cfg.make_vocab_size_divisible_by, parallel.tensor_model_parallel_size
        ),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    per_micro_batch_router_losses(model)
    # The local spec's torch norms are created in fp32 whatever params_dtype says; a bf16 model with fp32 norms
    # breaks megatron's Float16 optimizer, whose checkpoint maps state to params assuming every one is 16-bit.
    for p in model.parameters():
        if p.dtype != tcfg.params_dtype:
            p.data = p.data.to(tcfg.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def causal_attention_mask(seq_len: int, batch: int = 1, device=None) -> torch.Tensor:
    """Megatron's boolean mask convention: True = masked (future positions)."""
    m = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
    return m.view(1, 1, seq_len, seq_len).expand(batch, 1, seq_len, seq_len)
