"""Generate the K samples of every question group of this rank, one engine batch at a time.

Fresh questions get K samples; an experience question gets K-1 fresh samples and its stored
trajectory spliced in as the K-th (`splice_replay`), so replayed trajectories are never
regenerated. Request seeds are derived from the question id, so a question's samples do not
depend on which rank or batch it lands in.

Streaming: groups are generated in several engine calls (:func:`plan_calls`) and `on_chunk` is
called with each call's finished groups, so the caller can grade them while the next call generates.
The calls reproduce the engine's own batches exactly (megatron engine doc, point 1: the rows of one
call, sorted by prompt length, longest first, cut every `max_batch_sequences` rows, and with
`pad_free_batches` also where the prompt length changes): a cut is made only where a batch of the
one-call plan starts at a group's first row. Each call then runs exactly the batches that one call
for all groups would run, so the samples are bit-identical to it. An engine without
`max_batch_sequences` (vLLM, which batches continuously) gets one call per sample count.
"""

from __future__ import annotations

from collections.abc import Callable

from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.rollout.splice import splice_replay
from exgrpo_megatron.rollout.types import RolloutEngine, Sample, SamplingParams

ChunkCallback = Callable[[list[int], list[list[Sample]]], None]  # (group indices, their samples)


def plan_calls(prompt_lengths: list[int], n: int, max_rows: int | None, pad_free: bool = False) -> list[list[int]]:
    """Split groups (indices into `prompt_lengths`, n samples each) into engine calls along the engine's
    batches; each call lists its groups in index order. `max_rows=None`: one call.

    The engine's plan is simulated row by row, in its order (longest prompt first, then index): a row
    opens a batch when the current one is full (`max_rows`), or, with `pad_free`, has another prompt
    length. A group whose first row opens a batch starts a new call.
    """
    if max_rows is None:
        return [list(range(len(prompt_lengths)))] if prompt_lengths else []
    calls: list[list[int]] = []
    fill, batch_len = 0, -1  # rows in the current engine batch, and its prompt length
    for i in sorted(range(len(prompt_lengths)), key=lambda j: (-prompt_lengths[j], j)):
        length = prompt_lengths[i]
        for row in range(max(n, 1)):
            if fill == 0 or fill >= max_rows or (pad_free and length != batch_len):
                fill, batch_len = 0, length
                if row == 0:
                    calls.append([])
            fill += 1
        calls[-1].append(i)
    return [sorted(call) for call in calls]


def generate_groups(engine: RolloutEngine, groups: list[QuestionGroup], k: int, params: SamplingParams,
                    on_chunk: ChunkCallback | None = None) -> list[list[Sample]]:
    """Samples of every group (in `groups` order); `on_chunk(indices, samples)` after each engine call."""
    max_rows = getattr(engine, "max_batch_sequences", None)
    pad_free = bool(getattr(engine, "pad_free_batches", False))
    out: list[list[Sample]] = [[] for _ in groups]
    for n, replay in ((k, False), (k - 1, True)):
        idx = [i for i, g in enumerate(groups) if (g.replay is not None) == replay]
        for call in plan_calls([len(groups[i].prompt_ids) for i in idx], n, max_rows, pad_free):
            chunk = [idx[j] for j in call]
            samples = engine.generate([groups[i].prompt_ids for i in chunk], n, params,
                                      request_seeds=[groups[i].qid for i in chunk])
            for i, group_samples in zip(chunk, samples, strict=True):
                g = groups[i]
                if g.replay is not None:
                    group_samples = splice_replay(group_samples, g.prompt_ids, g.replay.token_ids.tolist(),
                                                  g.replay.logprobs.tolist())
                out[i] = group_samples
            if on_chunk is not None:
                on_chunk(chunk, [out[i] for i in chunk])
    return out
