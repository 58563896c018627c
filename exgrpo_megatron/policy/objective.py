"""Loss functions the megatron schedule calls on the last pipeline stage, per micro-batch.

`token_stats_fn` (forward only): log-probs of the targets and token entropies, used for old
log-probs, trajectory selection and the mismatch metric. `exgrpo_loss_fn`: the ExGRPO objective of
`algo/loss.py` on the chunked vocab-parallel log-probs and entropy (`policy/output_layer.py`).
"""

from __future__ import annotations

import torch

from exgrpo_megatron.algo.loss import exgrpo_loss
from exgrpo_megatron.policy.batch import MicroBatch
from exgrpo_megatron.policy.output_layer import LastStageOutput
from exgrpo_megatron.policy.policy import LossFn


def token_stats_fn(temperature: float, with_entropy: bool, vocab_size: int | None = None,
                   logprob_temperature: float | None = None) -> LossFn:
    """logprobs (and entropy) at `temperature`; with `logprob_temperature`, also "logprobs_at": the log-probs at
    that temperature from the same forward (the selection pass scores at T = 1 and keeps pi_old at the rollout
    temperature without a second model forward)."""
    def loss_fn(output: LastStageOutput, mb: MicroBatch):
        logp, ent = output.logprobs_entropy(mb, vocab_size=vocab_size, temperature=temperature,
                                            with_entropy=with_entropy, entropy_grad=False)
        out = {"logprobs": logp.detach()}
        if ent is not None:
            out["entropy"] = ent.detach()
        if logprob_temperature is not None:
            out["logprobs_at"] = logp.detach() if logprob_temperature == temperature else (
                output.logprobs_entropy(mb, vocab_size=vocab_size, temperature=logprob_temperature,
                                        with_entropy=False, entropy_grad=False)[0].detach())
        return (output.tensor.sum() * 0.0), out

    return loss_fn


def exgrpo_loss_fn(*, mixed_phase: bool, temperature: float, clip_ratio: float, shaping_beta: float,
                   entropy_coeff: float, policy_shaping: bool = True, pg_normaliser: float, entropy_normaliser: float,
                   vocab_size: int | None = None) -> LossFn:
    """Extras expected on each micro-batch: old_logprobs, behaviour_logprobs, advantages, replay. With the optional
    extra generation_logprobs (the first update of a step, weights still pi_old) the metrics also hold
    mismatch_sum / mismatch_count: sum and count of exp(|logp_generation - logp|) over fresh response tokens,
    the engine-vs-trainer mismatch measured on the training forward itself (no extra pass)."""

    def loss_fn(output: LastStageOutput, mb: MicroBatch):
        logp, ent = output.logprobs_entropy(mb, vocab_size=vocab_size, temperature=temperature,
                                            with_entropy=True, entropy_grad=entropy_coeff > 0)
        x = mb.extras
        loss, metrics = exgrpo_loss(
            logp, x["old_logprobs"], x["behaviour_logprobs"], x["advantages"], mb.loss_mask, x["replay"], ent,
            mixed_phase=mixed_phase, clip_ratio=clip_ratio, shaping_beta=shaping_beta, policy_shaping=policy_shaping,
            entropy_coeff=entropy_coeff,
            pg_normaliser=pg_normaliser, entropy_normaliser=entropy_normaliser,
        )
        if "generation_logprobs" in x:
            fresh = mb.loss_mask.bool() & ~x["replay"].bool()
            err = torch.exp((x["generation_logprobs"].double() - logp.detach().double()).abs())
            metrics = {**metrics, "mismatch_sum": err[fresh].sum(), "mismatch_count": fresh.sum().double()}
        return loss, metrics

    return loss_fn
