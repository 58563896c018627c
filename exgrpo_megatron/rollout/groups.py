"""Generate the K samples of every question group of this rank.

Fresh questions get K samples; an experience question gets K-1 fresh samples and its stored
trajectory spliced in as the K-th (`splice_replay`), so replayed trajectories are never
regenerated. Request seeds are derived from the question id, so a question's samples do not
depend on which rank or batch it lands in.

Streaming: one engine call per sample count (fresh groups: K, experience groups: K-1). The engine
reports the groups each of its batches finishes (`on_prompts_done`, rollout/types.py) and they are
forwarded to `on_chunk`, so the caller can grade them while the engine generates the next batch;
the samples are those of the same call without streaming.
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
    for n, replay in ((k, False), (k - 1, True)):
        idx = [i for i, g in enumerate(groups) if (g.replay is not None) == replay]
        if not idx:
            continue

        def finished(positions: list[int], samples: list[list[Sample]], idx: list[int] = idx) -> None:
            chunk = [idx[p] for p in positions]
            for i, group_samples in zip(chunk, samples, strict=True):
                stored = groups[i].replay
                if stored is not None:
                    group_samples = splice_replay(group_samples, groups[i].prompt_ids, stored.token_ids.tolist(),
                                                  stored.logprobs.tolist())
                out[i] = group_samples
            if on_chunk is not None:
                on_chunk(chunk, [out[i] for i in chunk])

        engine.generate([groups[i].prompt_ids for i in idx], n, params, request_seeds=[groups[i].qid for i in idx],
                        on_prompts_done=finished)
        if missing := [i for i in idx if not out[i]]:
            raise RuntimeError(f"{type(engine).__name__}.generate did not report groups {missing} as done")
    return out
