"""Which pi_old source a run uses (`algo.old_logprobs`), decided from the config alone.

The generation log-probs are pi_old exactly where the engine computes them as the policy does: the megatron
engine in fp32 (in bf16 its KV-cache decode rounds differently from the trainer's packed forward: the ratio
measured 1.03 on SmolLM2 on CPU, docs/precision.md); vLLM in fp32 with top_p = 1 and top-k off. auto picks
`rollout` there and `recompute` elsewhere; an explicit `rollout` where they are not exact is refused at
start-up (validate.py) and the trainer passes the resolved source to policy/old_logprobs.py.
"""

from __future__ import annotations

from exgrpo_megatron.config.derived import resolve_params_dtype, vllm_dtype
from exgrpo_megatron.config.schema import CHOICES, RootConfig


def rollout_logprobs_exact(engine: str, engine_dtype: str, top_p: float, top_k: int) -> bool:
    """Are the engine's generation log-probs the policy's own (same weights, same distribution, fp32 so the
    engine's decode rounds as the trainer's forward does)? The megatron engine's log-probs are the full softmax
    at T whatever top-p/top-k; its dtype is the policy's."""
    if engine == "megatron":
        return engine_dtype == "float32"
    return engine == "vllm" and engine_dtype == "float32" and top_p == 1.0 and top_k <= 0


def resolve_old_logprobs(mode: str, engine: str, engine_dtype: str, top_p: float, top_k: int) -> str:
    """algo.old_logprobs -> 'recompute' | 'rollout'; auto = rollout exactly where the rollout log-probs are exact.
    An explicit 'rollout' where they are not is refused (config validation names the key)."""
    modes = CHOICES["algo.old_logprobs"]
    if mode not in modes:
        raise ValueError(f"algo.old_logprobs: expected one of {modes}, got {mode!r}")
    exact = rollout_logprobs_exact(engine, engine_dtype, top_p, top_k)
    if mode == "auto":
        return "rollout" if exact else "recompute"
    if mode == "rollout" and not exact:
        raise ValueError(f"algo.old_logprobs: 'rollout' needs exact generation log-probs; the {engine} engine "
                         f"({engine_dtype}, top_p={top_p}, top_k={top_k}) does not give them; use auto or recompute")
    return mode


def resolve_old_logprobs_for(cfg: RootConfig) -> str:
    """`resolve_old_logprobs` for a run's config: the megatron engine's dtype is the policy's, the vLLM engine's is
    `rollout.vllm.dtype` as the engine factory resolves it (auto = the policy's parameter dtype)."""
    r = cfg.rollout
    if r.max_staleness > 0:  # the engine's log-probs are those of weights up to max_staleness updates old
        if cfg.algo.old_logprobs == "rollout":
            raise ValueError(f"algo.old_logprobs: 'rollout' with rollout.max_staleness={r.max_staleness}: the "
                             "generation log-probs are older weights'; pi_old must be recomputed (auto or recompute)")
        return "recompute" if cfg.algo.old_logprobs in ("auto", "recompute") else cfg.algo.old_logprobs
    policy_dtype = resolve_params_dtype(cfg.model)
    dtype = vllm_dtype(r.vllm.dtype if r.engine == "vllm" else "auto", policy_dtype)
    return resolve_old_logprobs(cfg.algo.old_logprobs, r.engine, dtype, r.top_p, r.top_k)
