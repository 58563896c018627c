"""The model's output layer and what the loss reads from it: per-token log-probs and entropies of the targets.

Two paths, chosen by `trainer.fused_output_logprobs`, with the same values and gradients:
- unfused: megatron's output layer (ColumnParallelLinear) materialises the vocab-parallel logits
  [b, s, V/tp], then `policy/logprobs.py` reduces them chunk by chunk;
- fused (default): the model stops before its output layer and returns the final hidden states [s, b, H]; only
  the loss tokens' rows are taken and `policy/fused_logprobs.py` computes logits, log-probs, entropy and the
  gradients of hidden states and output weight chunk by chunk, so no [tokens x vocab] tensor exists.

How the model stops before the output layer: megatron-core's GPTModel returns its decoder's hidden states (final
norm applied) when `post_process` is False, the documented pipeline-stage switch ("include an output layer");
`stop_before_output_layer` sets it for the duration of one forward call on the last stage and restores it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from exgrpo_megatron.policy.batch import MicroBatch
from exgrpo_megatron.policy.fused_logprobs import fused_output_logprobs_entropy
from exgrpo_megatron.policy.logprobs import vocab_parallel_logprobs_entropy
from exgrpo_megatron.rollout.sampling import mask_padded_vocab

FUSED_CHUNK_TOKENS = 256  # rows of one [chunk, V/tp] logits buffer in the fused path (bench/logprob_memory.py)


def mask_vocab_padding(logits: Tensor, vocab_size: int | None) -> Tensor:
    """Give megatron's padded vocabulary ids (>= vocab_size) no probability on this rank's TP shard
    with the rollout engine's own masking (`rollout.sampling.mask_padded_vocab`), so trainer and
    sampler log-probs agree."""
    if vocab_size is None:
        return logits
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    return mask_padded_vocab(logits, vocab_size, vocab_start=tp_rank * logits.shape[-1])


@contextmanager
def stop_before_output_layer(model: torch.nn.Module, fused: bool) -> Iterator[Tensor | None]:
    """Within the block, a forward of `model` (a megatron GPTModel, possibly DDP/Float16Module-wrapped) on the
    last pipeline stage returns the final hidden states [s, b, H] instead of logits when `fused`. Yields the
    output weight the skipped layer would have used (the embedding's when tied), or None when nothing is
    skipped (not fused, not the last stage, or sequence parallelism on: the fused path needs the full
    sequence's hidden states on every TP rank, so there the output layer runs unfused)."""
    from megatron.core.utils import get_attr_wrapped_model

    gpt = get_attr_wrapped_model(model, "post_process", return_model_obj=True)
    if not (fused and gpt.post_process) or gpt.output_layer.sequence_parallel:  # fused: hidden states not sharded
        yield None
        return
    weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
              else gpt.output_layer.weight)
    gpt.post_process = False
    try:
        yield weight
    finally:
        gpt.post_process = True


@dataclass
class LastStageOutput:
    """The last pipeline stage's model output for one micro-batch."""

    tensor: Tensor  # logits [b, s, V/tp] (unfused) or final hidden states [s, b, H] (fused)
    output_weight: Tensor | None = None  # this rank's output-weight shard [V/tp, H] when fused

    def logprobs_entropy(self, mb: MicroBatch, *, vocab_size: int | None, temperature: float = 1.0,
                         with_entropy: bool = True, entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
        """Log-probs of mb.labels and entropies of softmax(logits / temperature) over the first `vocab_size` ids
        (None: all), each [b, s]. Fused: computed on the loss-mask tokens only, 0 elsewhere (the loss masks them)."""
        if self.output_weight is None:
            logits = mask_vocab_padding(self.tensor, vocab_size)
            return vocab_parallel_logprobs_entropy(logits, mb.labels, temperature=temperature,
                                                   with_entropy=with_entropy, entropy_grad=entropy_grad)
        s, b, h = self.tensor.shape
        rows = mb.loss_mask.t().reshape(-1).nonzero().squeeze(-1)  # token positions in the [s, b] order
        targets = mb.labels.t().reshape(-1).index_select(0, rows)
        logp, ent = fused_output_logprobs_entropy(
            self.tensor.reshape(s * b, h).index_select(0, rows), self.output_weight, targets,
            vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max, chunk_size=FUSED_CHUNK_TOKENS,
            temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)

        def to_batch(values: Tensor) -> Tensor:
            return values.new_zeros(s * b).index_copy(0, rows, values).reshape(s, b).t()

        return to_batch(logp), (None if ent is None else to_batch(ent))
