"""Mixture-of-experts layers: megatron-core's `MoELayer` configured as Qwen3-MoE defines its sparse block.

Qwen3-MoE (transformers' `Qwen3MoeSparseMoeBlock`): router logits `l = W_g h` (no bias); routing weights
`p = softmax(l)` over all experts; the token goes to the top-k experts of `p`, weighted by their `p`, renormalised
to sum to 1 when `norm_topk_prob`; each expert is a SwiGLU MLP of width `moe_ffn_hidden_size`; no shared expert.
megatron-core's softmax router (`moe_utils.topk_routing_with_score_function`) computes the same two ways:
`moe_router_pre_softmax=False` takes the top-k of the logits and a softmax over those k, which is the renormalised
top-k of the full softmax (softmax is monotone, and the renormalisation cancels the full normaliser):
norm_topk_prob=True; `moe_router_pre_softmax=True` takes the top-k of the full softmax as it is: norm_topk_prob=False.
The router runs in fp32 (`moe_router_dtype`): the expert choice of near-tied logits must not depend on bf16 rounding.

Expert parallelism: `parallel.expert_model_parallel_size` (EP) ranks each hold `num_experts / EP` whole experts
(global expert `ep_rank * num_experts / EP + j` is local expert j); `parallel.expert_tensor_parallel_size` (ETP)
splits each expert's matrices as TP splits the dense MLP. Tokens reach their experts through the token dispatcher
(`model.moe_token_dispatcher`): `allgather` (every layout, CPU included), `alltoall` (GPU at scale) or `flex`
(DeepEP, GPU). Local spec: one `MLP` per local expert (`SequentialMLP`); TE spec with `model.moe_grouped_gemm`:
the local experts in one grouped GEMM (`TEGroupedMLP`).
"""

from __future__ import annotations

from typing import Any

from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig


def is_moe(cfg: ModelConfig) -> bool:
    return cfg.num_experts > 0


def expert_ffn_hidden_size(cfg: ModelConfig) -> int:
    return cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size


def moe_transformer_config(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
    """The `TransformerConfig` fields of the MoE layers (empty for a dense model)."""
    if not is_moe(cfg):
        return {}
    return {
        "num_moe_experts": cfg.num_experts,
        "moe_ffn_hidden_size": expert_ffn_hidden_size(cfg),
        "moe_router_topk": cfg.moe_router_topk,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not cfg.norm_topk_prob,  # see the module docstring
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss",  # Switch-style sum_e f_e P_e x E (megatron moe_utils)
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
        "moe_z_loss_coeff": cfg.moe_z_loss_coeff or None,
        "moe_grouped_gemm": cfg.moe_grouped_gemm,
        "moe_token_dispatcher_type": cfg.moe_token_dispatcher,
        "moe_flex_dispatcher_backend": "deepep",
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
    }


def per_micro_batch_router_losses(model: Any) -> None:
    """The load-balancing and z-losses of a micro-batch enter its loss as `coeff x` their mean over its tokens.

    With `calculate_per_token_loss` (our loss is a token sum over a global normaliser, policy/policy.py) megatron's
    routers multiply both by the micro-batch's token count, expecting the finalize step to divide every gradient by
    the global token count, which ours does not (our loss is already normalised). The router keeps its own copy of the
    flag (`TopKRouter.calculate_per_token_loss`); turning it off there leaves the coefficients as the config states.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.calculate_per_token_loss = False


def expert_parallel_group(model: Any) -> Any:
    """The expert-parallel process group when `model` has MoE layers split over more than one rank, else None."""
    from megatron.core import parallel_state as ps

    if not model.config.num_moe_experts or ps.get_expert_model_parallel_world_size() == 1:
        return None
    return ps.get_expert_model_parallel_group()
