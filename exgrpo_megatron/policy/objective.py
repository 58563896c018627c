"""Loss functions the megatron schedule calls on the last pipeline stage, per micro-batch.

`token_stats_fn` (forward only): log-probs of the targets and token entropies, used for old
log-probs, trajectory selection and the mismatch metric. `rl_loss_fn`: the algorithm's loss (algo/protocol.py)
on a `LossBatch`: the chunked vocab-parallel log-probs and entropy (`policy/output_layer.py`), the micro-batch's typed
`LossInputs` and its `sequences` (each token's sequence, padded or packed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exgrpo_megatron.algo.loss import mult_prob_error_sums
from exgrpo_megatron.algo.policy_loss import LossBatch
from exgrpo_megatron.algo.protocol import RLAlgorithm
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.policy.batch import MicroBatch
from exgrpo_megatron.policy.output_layer import LastStageOutput
from exgrpo_megatron.policy.policy import LossFn

LossObserver = Callable[[LastStageOutput, MicroBatch, torch.Tensor, dict[str, torch.Tensor]], None]


def token_stats_fn(temperature: float, with_entropy: bool, vocab_size: int | None = None,
                   logprob_temperature: float | None = None) -> LossFn:
    """logprobs (and entropy) at `temperature`; with `logprob_temperature`, also "logprobs_at": the log-probs at
    that temperature from the same forward (the selection pass scores at T = 1 and keeps pi_old at the rollout
    temperature without a second model forward)."""
    def loss_fn(output: LastStageOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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


def rl_loss_fn(algorithm: RLAlgorithm, *, phase: Phase, normalisers: tuple[float, float], temperature: float,
               vocab_size: int | None = None, observe: LossObserver | None = None) -> LossFn:
    """The algorithm's loss of one update's micro-batches (each carries `loss_inputs`) in `phase`, with the update's
    DP-global (pg, entropy) normalisers. With `LossInputs.measure_mismatch` the metrics also hold mismatch_sum /
    mismatch_count (the engine-vs-trainer mismatch measured on the training forward itself, no extra pass).
    `observe(output, mb, loss, metrics)`: called with each micro-batch's result (the trainer's observers)."""

    def loss_fn(output: LastStageOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = mb.loss_inputs
        if x is None:
            raise ValueError("rl_loss_fn: the micro-batch has no loss inputs (micro_batches_for_update sets them)")
        logp, ent = output.logprobs_entropy(mb, vocab_size=vocab_size, temperature=temperature,
                                            with_entropy=True, entropy_grad=algorithm.entropy_coeff > 0)
        old = logp.detach() if x.old_logprobs is None else x.old_logprobs  # None: weights still pi_old's
        batch = LossBatch(logp, ent, mb.loss_mask, old, x.behaviour_logprobs, x.advantages, x.replay, mb.sequences)
        loss, metrics = algorithm.loss(batch, phase=phase, normalisers=normalisers)
        if x.measure_mismatch:  # weights still pi_old's: exp(|logp_behaviour - logp|) over fresh tokens
            fresh = mb.loss_mask.bool() & ~x.replay.bool()
            total, count = mult_prob_error_sums(x.behaviour_logprobs, logp.detach(), fresh)
            metrics = {**metrics, "mismatch_sum": total, "mismatch_count": count}
        if observe is not None:
            observe(output, mb, loss, metrics)
        return loss, metrics

    return loss_fn
