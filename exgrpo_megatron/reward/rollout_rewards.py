"""Grade a step's rollout groups with the process-pool grader (one reward per sample).

`StreamingGrading` grades the groups while they are generated: pass its `submit` as the
`on_chunk` callback of `generate_groups`, and each engine call's groups go to the grader pool as
soon as they are done (the pool grades in the background while the next call generates); `result()`
then waits for the rest and returns the rewards in the same flat order as grading everything at once
(group by group, sample by sample), so nothing downstream sees the difference.
"""

from __future__ import annotations

from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.data.tokenizer import Tokenizer
from exgrpo_megatron.reward.grader import GradeHandle, GradeResult, GraderPool
from exgrpo_megatron.rollout.types import Sample


def response_text(tokenizer: Tokenizer, sample: Sample) -> str:
    """The response as the grader sees it: special tokens kept (the reference decodes them), the
    final EOS dropped."""
    ids = list(sample.response_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def submit_grading(grader: GraderPool, tokenizer: Tokenizer, groups: list[QuestionGroup],
                   samples: list[list[Sample]], require_think: bool) -> GradeHandle:
    items = [(response_text(tokenizer, s), g.answer, require_think)
             for g, group_samples in zip(groups, samples, strict=True) for s in group_samples]
    return grader.submit(items)


class StreamingGrading:
    """Grades `groups` chunk by chunk as their samples arrive (see module doc)."""

    def __init__(self, grader: GraderPool, tokenizer: Tokenizer, groups: list[QuestionGroup],
                 require_think: bool) -> None:
        self.grader, self.tokenizer, self.groups, self.require_think = grader, tokenizer, groups, require_think
        self._chunks: list[tuple[list[int], list[int], GradeHandle]] = []  # (group indices, group sizes, handle)

    def submit(self, indices: list[int], samples: list[list[Sample]]) -> None:
        """Queue the samples of groups `indices` (one list per group) for grading; returns at once."""
        handle = submit_grading(self.grader, self.tokenizer, [self.groups[i] for i in indices], samples,
                                self.require_think)
        self._chunks.append((list(indices), [len(s) for s in samples], handle))

    def result(self) -> GradeResult:
        """Wait for every chunk; rewards flat in group order. Every group must have been submitted once."""
        per_group: list[list[float] | None] = [None] * len(self.groups)
        kills = deaths = 0
        first, last = float("inf"), float("-inf")
        for indices, sizes, handle in self._chunks:
            graded = self.grader.result(handle)
            kills, deaths = kills + graded.n_timeouts_killed, deaths + graded.n_worker_deaths
            first, last = min(first, handle.submitted_at), max(last, handle.submitted_at + graded.seconds)
            for i, group_rewards in zip(indices, _split(graded.rewards, sizes), strict=True):
                if per_group[i] is not None:
                    raise ValueError(f"StreamingGrading: group {i} was submitted twice")
                per_group[i] = group_rewards
        missing = [i for i, r in enumerate(per_group) if r is None]
        if missing:
            raise ValueError(f"StreamingGrading: groups {missing} were never submitted")
        rewards = [x for group_rewards in per_group for x in group_rewards]  # type: ignore[union-attr]
        return GradeResult(rewards, kills, deaths, max(0.0, last - first) if self._chunks else 0.0)


def rewards_per_group(flat: list[float], samples: list[list[Sample]]) -> list[list[float]]:
    """Cut the flat rewards into one list per group."""
    return _split(flat, [len(group_samples) for group_samples in samples])


def _split(flat: list[float], sizes: list[int]) -> list[list[float]]:
    out, i = [], 0
    for size in sizes:
        out.append([float(x) for x in flat[i : i + size]])
        i += size
    return out
