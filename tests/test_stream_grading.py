"""Grading overlaps generation: the rollout engine reports the prompts each of its batches finishes
(`on_prompts_done`), generate_groups forwards them to StreamingGrading, which submits them to the real
GraderPool while the engine generates its next batch.

* The megatron engine reports every prompt once, right after the chunk that completes it (its own plan,
  `plan_chunks`), with the samples the call returns.
* With a real megatron engine and a real grader, the event order shows each batch's groups submitted for
  grading inside the engine call, and the streamed samples and rewards equal generating and grading
  everything at once, in the same order.
"""

from __future__ import annotations

import numpy as np

from tests.helpers.multirank import run_on_ranks

K = 4
MAX_ROWS = 8  # two fresh groups of K per engine batch


class _Recorder:
    """Proxies an engine or a grader pool, logging generate()/submit() calls into a shared event list."""

    def __init__(self, inner, events: list[tuple[str, int]]) -> None:
        self._inner, self._events = inner, events

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, prompts, n, params, request_seeds=None, on_prompts_done=None):
        self._events.append(("generate", len(prompts)))
        out = self._inner.generate(prompts, n, params, request_seeds=request_seeds, on_prompts_done=on_prompts_done)
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
        one_shot = generate_groups(engine, groups, K, params)
        one_shot_rewards = pool.result(
            submit_grading(pool, tokenizer, groups, one_shot, require_think=False)).rewards
    as_lists = [[(s.response_ids, s.logprobs, s.is_replay) for s in g] for g in streamed]
    return {"events": events, "streamed": as_lists, "streamed_rewards": streamed_rewards, **_engine_reports(engine),
            "one_shot": [[(s.response_ids, s.logprobs, s.is_replay) for s in g] for g in one_shot],
            "one_shot_rewards": one_shot_rewards}


def _engine_reports(engine) -> dict:
    """The megatron engine's on_prompts_done reports for one call over prompts of mixed lengths, and what its
    own chunk plan says they must be: after each chunk, the prompts it completed."""
    from exgrpo_megatron.rollout.megatron_engine import plan_chunks
    from exgrpo_megatron.rollout.types import SamplingParams

    prompts = [[5, 6, 7], [8, 9], [5, 6, 7, 8], [9, 10], [11, 12, 13]]
    n, params = 3, SamplingParams(max_new_tokens=4, seed=3)
    reports: list[tuple[list[int], list]] = []
    returned = engine.generate(prompts, n, params, on_prompts_done=lambda idx, s: reports.append((idx, s)))
    rows = [(i, j, 0) for i in range(len(prompts)) for j in range(n)]
    seen: dict[int, int] = {}
    expected = []
    for chunk in plan_chunks([len(p) for p in prompts], rows, engine.max_batch_sequences, engine.pad_free_batches):
        for i, _, _ in chunk:
            seen[i] = seen.get(i, 0) + 1
        expected.append(sorted({i for i, _, _ in chunk if seen[i] == n}))
    as_lists = lambda groups: [[(s.response_ids, s.logprobs) for s in g] for g in groups]
    return {"reported": [idx for idx, _ in reports], "expected_reports": [e for e in expected if e],
            "reported_samples": [as_lists(s) for _, s in reports],
            "returned_samples": [as_lists([returned[i] for i in idx]) for idx, _ in reports]}


def test_chunks_are_graded_while_the_next_chunk_generates_with_identical_results():
    got = run_on_ranks(_stream_vs_one_shot, 1)[0]
    # the engine reports each prompt once, after the chunk that completes it, with the samples it returns
    assert got["reported"] == got["expected_reports"] and len(got["reported"]) > 1
    assert sorted(i for idx in got["reported"] for i in idx) == list(range(5))
    assert got["reported_samples"] == got["returned_samples"]
    # ONE engine call for the 5 fresh groups (K rows each) and the replay group (K-1 rows): 23 rows in batches of
    # 8, each batch's completed groups graded inside the call (the replay group with its spliced K-th sample)
    assert got["events"][0] == ("generate", 6) and got["events"][-1] == ("generated", 6)
    submits = got["events"][1:-1]
    assert all(kind == "submit" for kind, _ in submits) and len(submits) > 1
    assert sum(items for _, items in submits) == 6 * K
    assert got["streamed"] == got["one_shot"]  # bit-identical samples
    assert got["streamed_rewards"] == got["one_shot_rewards"]  # same rewards, same order
    assert got["streamed"][2][-1][2] and got["streamed_rewards"][2 * K + K - 1] == 1.0  # the spliced correct replay


def _validation_stream_vs_after() -> dict:
    """In-training validation (the rollout service's `rewards`) against the pre-streaming order: generate every
    group, then grade them all (what validate_accuracy did before)."""
    from exgrpo_megatron.reward.grader import GraderPool
    from exgrpo_megatron.reward.rollout_rewards import submit_grading
    from exgrpo_megatron.rollout.groups import generate_groups
    from exgrpo_megatron.rollout.types import SamplingParams
    from exgrpo_megatron.training.rollout_service import RolloutService

    tokenizer, engine = _tiny_engine()
    params = SamplingParams(max_new_tokens=10, temperature=0.6, seed=10_007)
    groups = [g for g in _groups(tokenizer) if g.replay is None]  # validation has no replay
    with GraderPool(num_workers=2, timeout_seconds=2, hard_deadline_seconds=20.0) as pool:
        events: list[tuple[str, int]] = []
        service = RolloutService(_Recorder(engine, events), _Recorder(pool, events), tokenizer, require_think=False)
        streamed = service.rewards(groups, K, params)
        samples = generate_groups(engine, groups, K, params)
        after = pool.result(submit_grading(pool, tokenizer, groups, samples, require_think=False)).rewards
    return {"events": events, "streamed": streamed, "after": after}


def test_validation_grades_while_generating_with_the_same_rewards():
    got = run_on_ranks(_validation_stream_vs_after, 1)[0]
    assert got["events"] == [("generate", 5), ("submit", 8), ("submit", 8), ("submit", 4), ("generated", 5)]
    assert got["streamed"] == got["after"] and len(got["after"]) == 5 * K
