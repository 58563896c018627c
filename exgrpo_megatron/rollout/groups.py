"""Generate the K samples of every question group of this rank, in ONE engine call.

Fresh questions get K samples; an experience question gets K-1 fresh samples and its stored
trajectory spliced in as the K-th (`splice_replay`), so replayed trajectories are never
regenerated. Both kinds go to the engine together, with per-prompt sample counts (K or K-1): one
batch of rows instead of a call per kind (a mixed step's two calls ran the decode loop twice over
half-empty batches). Request seeds are derived from the question id and sample j of a group uses
row seed (call seed, qid, j) whatever else is in the call, so a question's samples do not depend
on which rank, batch or call it lands in (up to the fp rounding of different batch shapes, see
rollout/megatron_engine.py).

Streaming: the engine reports the groups each of its batches finishes (`on_prompts_done`,
rollout/types.py) and they are forwarded to `on_chunk`, so the caller can grade them while the
engine generates the next batch; the samples are those of the same call without streaming.
"""

from __future__ import annotations

from collections.abc import Callable

from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.rollout.splice import splice_replay
from exgrpo_megatron.rollout.types import RolloutEngine, Sample, SamplingParams

ChunkCallback = Callable[[list[int], list[list[Sample]]], None]  # (group indices, their samples)


def generate_groups(engine: RolloutEngine, groups: list[QuestionGroup], k: int, params: SamplingParams,
                    on_chunk: ChunkCallback | None = None) -> list[list[Sample]]:
    """Samples of every group (in `groups` order); `on_chunk(indices, samples)` for the groups of each engine
    batch as it finishes (indices ascending within a batch)."""
    out: list[list[Sample]] = [[] for _ in groups]

    def finished(positions: list[int], samples: list[list[Sample]]) -> None:
        for i, group_samples in zip(positions, samples, strict=True):
            stored = groups[i].replay
            if stored is not None:
                group_samples = splice_replay(group_samples, groups[i].prompt_ids, stored.token_ids.tolist(),
                                              stored.logprobs.tolist())
            out[i] = group_samples
        if on_chunk is not None:
            on_chunk(positions, [out[i] for i in positions])

    counts = [k if g.replay is None else k - 1 for g in groups]
    n: int | list[int] = counts if len(set(counts)) > 1 else (counts[0] if counts else k)  # one count if all share it
    # called with no groups too: under expert parallelism the megatron engine's forwards are rounds every rank joins
    engine.generate([g.prompt_ids for g in groups], n, params, request_seeds=[g.qid for g in groups],
                    on_prompts_done=finished)
    if missing := [i for i, samples in enumerate(out) if not samples]:
        raise RuntimeError(f"{type(engine).__name__}.generate did not report groups {missing} as done")
    return out
