"""Loss functions the megatron schedule calls on the last pipeline stage, per micro-batch.

`token_stats_fn` (forward only): log-probs of the targets and token entropies, used for old
log-probs, trajectory selection and the mismatch metric. `exgrpo_loss_fn`: the ExGRPO objective of
`algo/loss.py` on the chunked vocab-parallel log-probs and entropy (`policy/output_layer.py`).
"""

from __future__ import annotations

from exgrpo_megatron.algo.loss import exgrpo_loss
from exgrpo_megatron.policy.batch import MicroBatch
from exgrpo_megatron.policy.output_layer import LastStageOutput
from exgrpo_megatron.policy.policy import LossFn


def token_stats_fn(temperature: float, with_entropy: bool, vocab_size: int | None = None) -> LossFn:
    def loss_fn(output: LastStageOutput, mb: MicroBatch):
        logp, ent = output.logprobs_entropy(mb, vocab_size=vocab_size, temperature=temperature,
                                            with_entropy=with_entropy, entropy_grad=False)
        out = {"logprobs": logp.detach()}
        if ent is not None:
            out["entropy"] = ent.detach()
        return (output.tensor.sum() * 0.0), out

    return loss_fn


def exgrpo_loss_fn(*, mixed_phase: bool, temperature: float, clip_ratio: float, shaping_beta: float,
                   entropy_coeff: float, policy_shaping: bool = True, pg_normaliser: float, entropy_normaliser: float,
                   vocab_size: int | None = None) -> LossFn:
    """Extras expected on each micro-batch: old_logprobs, behaviour_logprobs, advantages, replay."""

    def loss_fn(output: LastStageOutput, mb: MicroBatch):
        logp, ent = output.logprobs_entropy(mb, vocab_size=vocab_size, temperature=temperature,
                                            with_entropy=True, entropy_grad=entropy_coeff > 0)
        x = mb.extras
        return exgrpo_loss(
            logp, x["old_logprobs"], x["behaviour_logprobs"], x["advantages"], mb.loss_mask, x["replay"], ent,
            mixed_phase=mixed_phase, clip_ratio=clip_ratio, shaping_beta=shaping_beta, policy_shaping=policy_shaping,
            entropy_coeff=entropy_coeff,
            pg_normaliser=pg_normaliser, entropy_normaliser=entropy_normaliser,
        )

    return loss_fn
