"""Grading overlaps generation: generate_groups calls the engine one engine batch at a time and hands each
call's groups to StreamingGrading, which submits them to the real GraderPool before the next call starts.

* The call plan reproduces the megatron engine's own batches (checked against the engine's planner), so
  the chunked calls return bit-identical samples to one call, and the streamed rewards equal grading
  everything at once, in the same order.
* With a real megatron engine and a real grader, the event order shows chunk 1 submitted for grading
  before chunk 2 is generated.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from exgrpo_megatron.rollout.groups import plan_calls
from tests.helpers.multirank import run_on_ranks

K = 4
MAX_ROWS = 8  # two fresh groups of K per engine batch


def _engine_batches(groups: list[int], lengths: list[int], n: int, max_rows: int, pad_free: bool):
    """The megatron engine's batches for one call over `groups`, rows named by (group, sample)."""
    from exgrpo_megatron.rollout.megatron_engine import plan_chunks

    rows = [(p, j, 0) for p in range(len(groups)) for j in range(n)]
    chunks = plan_chunks([lengths[g] for g in groups], rows, max_rows, pad_free)
    return [[(groups[p], j) for p, j, _ in chunk] for chunk in chunks]


@pytest.mark.parametrize("pad_free", [False, True])
def test_call_plan_reproduces_the_engine_batches(pad_free):
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.choice([3, 5, 5, 8, 13]) for _ in range(rng.randint(1, 12))]
        n, max_rows = rng.randint(1, 8), rng.randint(1, 20)
        calls = plan_calls(lengths, n, max_rows, pad_free)
        assert sorted(g for call in calls for g in call) == list(range(len(lengths)))
        chunked = [b for call in calls for b in _engine_batches(call, lengths, n, max_rows, pad_free)]
        assert chunked == _engine_batches(list(range(len(lengths))), lengths, n, max_rows, pad_free)
    assert plan_calls([5, 7, 5, 3, 9, 5], 4, 8) == [[1, 4], [0, 2], [3, 5]]  # longest first, 2 groups per batch
    assert plan_calls([5, 5], 4, 3) == [[0, 1]]  # an engine batch straddles the groups: one call
    assert plan_calls([5, 6, 5], 4, None) == [[0, 1, 2]]  # an engine without batches: one call, index order


class _Recorder:
    """Proxies an engine or a grader pool, logging generate()/submit() calls into a shared event list."""

    def __init__(self, inner, events: list[tuple[str, int]], hide_batching: bool = False) -> None:
        self._inner, self._events, self._hide = inner, events, hide_batching

    def __getattr__(self, name):
        if self._hide and name in ("max_batch_sequences", "pad_free_batches"):
            raise AttributeError(name)  # the pre-streaming path: one engine call per sample count
        return getattr(self._inner, name)

    def generate(self, prompts, n, params, request_seeds=None):
        self._events.append(("generate", len(prompts)))
        out = self._inner.generate(prompts, n, params, request_seeds=request_seeds)
        self._events.append(("generated", len(prompts)))
        return out

    def submit(self, items):
        self._events.append(("submit", len(items)))
        return self._inner.submit(items)


def _groups(tokenizer):
    from exgrpo_megatron.data.step_plan import QuestionGroup
    from exgrpo_megatron.data.synthetic import build_arithmetic_prompt_dataset
    from exgrpo_megatron.experience.types import Trajectory

    data = build_arithmetic_prompt_dataset(6, 3, tokenizer, template="plain", max_prompt_length=48)
    groups = [QuestionGroup(q, data[q].prompt_ids, data[q].answer) for q in data.qids()]
    # one experience question: its stored trajectory is a correct answer, spliced in as the K-th sample
    replayed = tokenizer.encode(f"</think> \\boxed{{{groups[2].answer}}}") + [tokenizer.eos_token_id]
    stored = Trajectory(np.asarray(replayed, dtype=np.int32), np.full(len(replayed), -0.5, dtype=np.float32), step=1)
    groups[2] = QuestionGroup(groups[2].qid, groups[2].prompt_ids, groups[2].answer, replay=stored)
    return groups



def _tiny_engine():
    """(char tokenizer, megatron KV-cache engine over a 2-layer model), in a fresh single-rank process."""
    from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine

    init_distributed(seed=5)
    tokenizer = load_tokenizer("char")
    model = build_gpt_model(ModelConfig(vocab_size=103, make_vocab_size_divisible_by=64, num_layers=2, hidden_size=64,
                                        ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                                        max_position_embeddings=128), ParallelConfig())
    return tokenizer, MegatronRolloutEngine(model, tokenizer, vocab_size=103, max_batch_sequences=MAX_ROWS)

def _stream_vs_one_shot() -> dict:
    from exgrpo_megatron.reward.grader import GraderPool
    from exgrpo_megatron.reward.rollout_rewards import StreamingGrading, submit_grading
    from exgrpo_megatron.rollout.groups import generate_groups
    from exgrpo_megatron.rollout.types import SamplingParams

    tokenizer, engine = _tiny_engine()
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=9)
    groups = _groups(tokenizer)
    with GraderPool(num_workers=2, timeout_seconds=2, hard_deadline_seconds=20.0) as pool:
        events: list[tuple[str, int]] = []
        # require_think=False: every response, random text included, goes through Math-Verify in the workers
        grading = StreamingGrading(_Recorder(pool, events), tokenizer, groups, require_think=False)
        streamed = generate_groups(_Recorder(engine, events), groups, K, params, on_chunk=grading.submit)
        streamed_rewards = grading.result().rewards
        one_shot = generate_groups(_Recorder(engine, [], hide_batching=True), groups, K, params)
        one_shot_rewards = pool.result(
            submit_grading(pool, tokenizer, groups, one_shot, require_think=False)).rewards
    as_lists = [[(s.response_ids, s.logprobs, s.is_replay) for s in g] for g in streamed]
    return {"events": events, "streamed": as_lists, "streamed_rewards": streamed_rewards,
            "one_shot": [[(s.response_ids, s.logprobs, s.is_replay) for s in g] for g in one_shot],
            "one_shot_rewards": one_shot_rewards}


def test_chunks_are_graded_while_the_next_chunk_generates_with_identical_results():
    got = run_on_ranks(_stream_vs_one_shot, 1)[0]
    # 5 fresh groups of K=4 in batches of 8 rows -> calls of 2, 2, 1 groups; then the replay group (K-1 rows)
    assert got["events"] == [("generate", 2), ("generated", 2), ("submit", 8),
                             ("generate", 2), ("generated", 2), ("submit", 8),
                             ("generate", 1), ("generated", 1), ("submit", 4),
                             ("generate", 1), ("generated", 1), ("submit", 4)]
    assert got["streamed"] == got["one_shot"]  # bit-identical samples (same engine batches)
    assert got["streamed_rewards"] == got["one_shot_rewards"]  # same rewards, same order
    assert got["streamed"][2][-1][2] and got["streamed_rewards"][2 * K + K - 1] == 1.0  # the spliced correct replay


def _validation_stream_vs_after() -> dict:
    """In-training validation (evaluation_loop.validation_rewards) against the pre-streaming order: generate every
    group, then grade them all (what validate_accuracy did before)."""
    from exgrpo_megatron.evaluation_loop import validation_rewards
    from exgrpo_megatron.reward.grader import GraderPool
    from exgrpo_megatron.reward.rollout_rewards import submit_grading
    from exgrpo_megatron.rollout.groups import generate_groups
    from exgrpo_megatron.rollout.types import SamplingParams

    tokenizer, engine = _tiny_engine()
    params = SamplingParams(max_new_tokens=10, temperature=0.6, seed=10_007)
    groups = [g for g in _groups(tokenizer) if g.replay is None]  # validation has no replay
    with GraderPool(num_workers=2, timeout_seconds=2, hard_deadline_seconds=20.0) as pool:
        events: list[tuple[str, int]] = []
        streamed = validation_rewards(_Recorder(engine, events), _Recorder(pool, events), tokenizer, groups, K,
                                      params, require_think=False)
        samples = generate_groups(_Recorder(engine, [], hide_batching=True), groups, K, params)
        after = pool.result(submit_grading(pool, tokenizer, groups, samples, require_think=False)).rewards
    return {"events": events, "streamed": streamed, "after": after}


def test_validation_grades_while_generating_with_the_same_rewards():
    got = run_on_ranks(_validation_stream_vs_after, 1)[0]
    assert got["events"] == [("generate", 2), ("generated", 2), ("submit", 8),
                             ("generate", 2), ("generated", 2), ("submit", 8),
                             ("generate", 1), ("generated", 1), ("submit", 4)]
    assert got["streamed"] == got["after"] and len(got["after"]) == 5 * K
