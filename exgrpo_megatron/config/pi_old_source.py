"""Which pi_old source a run uses (`algo.old_logprobs`), decided from the config alone.

- `rollout`: the generation log-probs. They are pi_old exactly where the engine computes them as the policy does:
  the megatron engine in fp32 (in bf16 its KV-cache decode rounds differently from the trainer's packed forward:
  the ratio measured 1.03 on SmolLM2 on CPU, docs/precision.md) and vLLM in fp32 with top_p = 1 and top-k off,
  and only when generation is not ahead of training (`rollout.max_staleness` = 0).
- `training_forward`: with one optimizer update per step (`trainer.ppo_mini_batch_size` = `train_batch_size`) that
  update's forward runs on the weights the step starts from, so its own log-probs, detached, ARE the trainer's
  pi_old: no extra pass, the fresh-token ratio is exactly 1 and only its gradient acts. Later updates of a step
  run on changed weights, so with several updates per step (several mini-batches, or `trainer.update_epochs` > 1
  passes over the rollouts) it is refused.
- `recompute`: a forward pass of every row before the updates (any number of updates per step).

auto = rollout where exact, else training_forward with one update per step, else recompute. An explicit source the
run cannot honour is refused at start-up (validate.py); the trainer passes the resolved source to
policy/old_logprobs.py.
"""

from __future__ import annotations

from exgrpo_megatron.config.derived import optimizer_updates_per_step, resolve_params_dtype, vllm_dtype
from exgrpo_megatron.config.schema import CHOICES, RootConfig


def rollout_logprobs_exact(engine: str, engine_dtype: str, top_p: float, top_k: int) -> bool:
    """Are the engine's generation log-probs the policy's own (same weights, same distribution, fp32 so the
    engine's decode rounds as the trainer's forward does)? The megatron engine's log-probs are the full softmax
    at T whatever top-p/top-k; its dtype is the policy's."""
    if engine == "megatron":
        return engine_dtype == "float32"
    return engine == "vllm" and engine_dtype == "float32" and top_p == 1.0 and top_k <= 0


def resolve_old_logprobs(mode: str, rollout_exact: bool, updates: int, why_inexact: str = "",
                         update_epochs: int = 1) -> str:
    """algo.old_logprobs -> 'rollout' | 'training_forward' | 'recompute' (module docstring). `rollout_exact`: the
    generation log-probs are pi_old (`rollout_logprobs_exact`, and not generated ahead); `updates`: optimizer
    updates per step (`update_epochs` passes included). A source the run cannot honour raises ValueError naming the
    key."""
    modes = CHOICES["algo.old_logprobs"]
    if mode not in modes:
        raise ValueError(f"algo.old_logprobs: expected one of {modes}, got {mode!r}")
    if mode == "auto":
        return "rollout" if rollout_exact else "training_forward" if updates == 1 else "recompute"
    if mode == "rollout" and not rollout_exact:
        raise ValueError(f"algo.old_logprobs: 'rollout' needs exact generation log-probs; {why_inexact} does not give "
                         "them; use auto, training_forward or recompute")
    if mode == "training_forward" and update_epochs > 1:
        raise ValueError(f"trainer.update_epochs: {update_epochs} passes over the step's rollouts need pi_old fixed "
                         "before the first update, and algo.old_logprobs='training_forward' takes it from the one "
                         "update's forward; use algo.old_logprobs=auto or recompute, or trainer.update_epochs=1")
    if mode == "training_forward" and updates != 1:
        raise ValueError(f"algo.old_logprobs: 'training_forward' needs one optimizer update per step; {updates} "
                         "updates (trainer.train_batch_size / ppo_mini_batch_size) run the later ones on changed "
                         "weights; use auto or recompute")
    return mode


def resolve_old_logprobs_for(cfg: RootConfig) -> str:
    """`resolve_old_logprobs` for a run's config: the megatron engine's dtype is the policy's, the vLLM engine's is
    `rollout.vllm.dtype` as the engine factory resolves it (auto = the policy's parameter dtype); generated ahead
    (`rollout.max_staleness` > 0), the generation log-probs are older weights' and never pi_old."""
    r, updates, epochs = cfg.rollout, optimizer_updates_per_step(cfg.trainer), cfg.trainer.update_epochs
    if r.max_staleness > 0:
        why = f"rollout.max_staleness={r.max_staleness} (the engine's weights are older)"
        return resolve_old_logprobs(cfg.algo.old_logprobs, False, updates, why, epochs)
    dtype = vllm_dtype(r.vllm.dtype if r.engine == "vllm" else "auto", resolve_params_dtype(cfg.model))
    why = f"the {r.engine} engine ({dtype}, top_p={r.top_p}, top_k={r.top_k})"
    return resolve_old_logprobs(cfg.algo.old_logprobs, rollout_logprobs_exact(r.engine, dtype, r.top_p, r.top_k),
                                updates, why, epochs)
