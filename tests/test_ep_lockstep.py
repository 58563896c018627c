"""Expert parallelism with unequal data per rank: the trainer at EP=2 never hangs and logs EP=1's numbers.

Under EP every model forward is a collective of the EP ranks, and the ranks hold different data. These runs give
the two ranks unequal work on purpose, and check that the unequal work really happened (the harness records what
each rank brought to every pass site, `Lockstep.observers`):
  * the replay scorer with candidates on one rank and none on the other (a drawn question with one stored
    trajectory needs no score), and the replayed rows' pi_old forward likewise;
  * different response lengths, so different micro-batch counts and generation rounds;
  * a validation whose single question lands on one rank (the other generates nothing);
  * DAPO's filter leaving a rank with no kept fresh group, so only it generates in the refill rounds while the
    other joins with nothing;
over the warm-up, collecting and mixed phases. Each run is compared step by step with the same run at EP=1 (DP=2
either way: EP takes its ranks from DP, so the data split is the same). A hang fails the test in bounded time
(`run_on_ranks`' timeout): with any rank-local skip of a forward put back, these runs hang.
"""

from __future__ import annotations

import math

import pytest

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks

RUN_TIMEOUT_S = 420.0  # one trainer run takes ~1-2 min on a busy 2-core machine; a hang ends here, not at gloo's 30 min
PASS_TIMEOUT_S = 150.0  # the passes with one empty rank: ~15 s
NOT_COMPARED = ("time/", "throughput/", "train/padding_share")  # wall clock; EP pads to the busiest rank's count
# fp32: an EP=2 expert GEMM holds both ranks' tokens, an EP=1 one a rank's own, so sums round differently (~1e-7 of a
# logit); through a few updates that reaches ~1e-5 relative (measured: the grad norm of a fourth step at 4 ranks,
# 1.0e-5), so the bound is tests/test_moe_parallel.py's trainer bound, 1e-4. A lost or extra gradient is far larger.
REL, ABS = 1e-4, 1e-7


def _overrides(run_dir: str, sft_dir: str, ep: int, extra: tuple[str, ...]) -> list[str]:
    return ["model=demo_qwen3_moe", "model.params_dtype=fp32", f"parallel.expert_model_parallel_size={ep}",
            f"trainer.sft_cache_dir={sft_dir}", f"logging.run_dir={run_dir}", "logging.tensorboard=false",
            "logging.progress_bar=false", "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2",
            "rollout.n=4", "data.max_response_length=24", "data.num_val_examples=1", "checkpoint.save_every=100",
            # a grading timeout on a loaded machine would change a reward in one run only
            "reward.timeout_seconds=30", "reward.hard_deadline_seconds=120", *extra]


# ------------------------------------------------------------------------- one rank with work, the other with none
def passes_with_one_empty_rank(ep: int) -> dict:
    """Rank 0 has rows, prompts and an update; rank 1 has none of them, and calls every pass all the same: the
    pi_old forward, an update (its optimizer step too) and generation with no prompt. Rank 0's results must be EP=1's
    (there rank 1 has nothing to join)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.data.step_plan import QuestionGroup
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import TrainBatch, micro_batches_for_update, token_stats
    from exgrpo_megatron.rollout.groups import generate_groups
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams
    from tests.test_moe_parallel import MOE, _rows

    cfg = load_config("demo_cpu", [*MOE, f"parallel.expert_model_parallel_size={ep}"])
    init_distributed(seed=cfg.seed, expert_model_parallel_size=ep)
    policy = Policy(cfg)
    sites: list[tuple[str, int, int]] = []
    policy.lockstep.observers.append(lambda site, mine, agreed: sites.append((site, mine, agreed)))
    rows = _rows()
    mine = list(range(6)) if dist.get_rank() == 0 else []
    stats = token_stats(policy, [rows.sequences[i] for i in mine], [rows.prompt_lengths[i] for i in mine],
                        site="old_logprobs", temperature=1.0, with_entropy=True, max_tokens=24)
    batch = TrainBatch.of(rows, old_logprobs=None)
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    counts = global_loss_counts([batch.response_lengths[i] for i in mine], ps.get_data_parallel_group())
    loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=algorithm.normalisers(*counts), temperature=1.0)
    policy.train()
    policy.zero_grad()
    metrics = policy.forward_backward(micro_batches_for_update(batch, mine, max_tokens=24), loss_fn, site="update")
    result = policy.optimizer_step(skip_grad_bound=1e9)
    engine = MegatronRolloutEngine(policy.modules[0], vocab_size=128, max_batch_sequences=4)
    prompts = [[5, 9, 17, 3], [40, 2]] if dist.get_rank() == 0 else []
    groups = [QuestionGroup(q, p, "") for q, p in enumerate(prompts)]
    samples = generate_groups(engine, groups, 2, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
    return {"logprobs": [t.tolist() for t in stats.logprobs], "entropy": [t.tolist() for t in stats.entropy or []],
            "losses": [float(m["pg_loss"]) for m in metrics], "grad_norm": result.grad_norm, "sites": sites,
            "samples": [(s.response_ids, s.logprobs) for g in samples for s in g]}


def test_a_rank_without_work_joins_every_pass_at_ep2():
    ref = run_on_ranks(passes_with_one_empty_rank, 2, args=(1,), timeout=PASS_TIMEOUT_S)
    got = run_on_ranks(passes_with_one_empty_rank, 2, args=(2,), timeout=PASS_TIMEOUT_S)
    empty = got[1]
    assert empty["logprobs"] == [] and empty["losses"] == [] and empty["samples"] == []
    assert [s[0] for s in empty["sites"]] == ["old_logprobs", "update"] and all(m == 0 for _, m, _ in empty["sites"])
    assert [(s, a) for s, _, a in empty["sites"]] == [(s, a) for s, _, a in got[0]["sites"]]  # agreed alike
    # EP=1: no forward to join; the update still joins the data-parallel gradient sync (one padding micro-batch)
    assert ref[1]["sites"] == [("old_logprobs", 0, 0), ("update", 0, ref[0]["sites"][1][1])]
    r, g = ref[0], got[0]
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert g["losses"] == pytest.approx(r["losses"], rel=1e-5, abs=1e-7)
    for key in ("logprobs", "entropy"):
        for a, b in zip(g[key], r[key], strict=True):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert [ids for ids, _ in g["samples"]] == [ids for ids, _ in r["samples"]] and g["samples"]


def test_the_scorer_is_called_on_a_rank_without_multi_candidate_questions():
    """Under EP the scorer's forward is a collective: a rank whose drawn questions have one stored trajectory each
    still calls it (with nothing), and its choices are those without scores."""
    import numpy as np

    from exgrpo_megatron.experience.selection import choose_trajectories
    from exgrpo_megatron.experience.types import Trajectory

    calls = []

    def scorer(qids, candidates):
        calls.append((list(qids), len(candidates)))
        return []

    one = [[Trajectory(np.array([1, 2], np.int32), np.array([-0.1, -0.2], np.float32), 1)] for _ in range(2)]
    chosen = choose_trajectories([3, 4], one, "ent", scorer, np.random.default_rng(0))
    assert calls == [([], 0)]
    assert [c[0] for c in chosen] == [one[0][0], one[1][0]] and all(c[1] is None for c in chosen)
    assert choose_trajectories([], [], "ent", scorer, np.random.default_rng(0)) == [] and len(calls) == 2
    choose_trajectories([3, 4], one, "random", scorer, np.random.default_rng(0))
    assert len(calls) == 2  # random needs no scores: no pass on any rank


# ---------------------------------------------------------------------------------- the trainer, ranks unequal
def train_recording_sites(overrides: list[str]) -> dict:
    """run_training, recording per step what this rank brought to each pass site (site, its count, the agreed
    count; "idle_round": a generation round it joined with nothing of its own), the groups of each generation round,
    and the first groups' graded rewards per step."""
    from exgrpo_megatron.logging import read_metrics
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    sites: list[tuple[int, str, int, int]] = []
    rounds: list[tuple[int, int]] = []  # (step, groups this rank generated in one round)
    first_round_rewards: dict[int, list[list[float]]] = {}
    step_now = [0]

    class Record(StepObserver):
        def started(self, c) -> None:
            c.policy.lockstep.observers.append(lambda site, mine, agreed: sites.append((step_now[0], site, mine,
                                                                                          agreed)))
            c.rollout.engine.lockstep.observers.append(
                lambda site, mine, agreed: None if mine == agreed else sites.append((step_now[0], "idle_round", 0, 1)))

        def begin(self, step) -> None:
            step_now[0] = step

        def generated(self, step, groups, samples) -> None:
            rounds.append((step, len(groups)))

        def rolled_out(self, step, rollouts) -> None:
            first_round_rewards[step] = [list(r) for r in rollouts.graded_rewards[:2]]  # the B / DP first groups

    cfg = load_config("demo_cpu", overrides)
    assert run_training(cfg, observers=[Record()]) == 0
    return {"metrics": read_metrics(f"{cfg.logging.run_dir}/metrics.jsonl"), "sites": sites, "rounds": rounds,
            "first_round_rewards": first_round_rewards}


def _run(tmp_path, sft_dir: str, ep: int, extra: tuple[str, ...], world: int = 2) -> list[dict]:
    run_dir = str(tmp_path / f"ep{ep}")
    return run_on_ranks(train_recording_sites, world, args=(_overrides(run_dir, sft_dir, ep, extra),),
                        timeout=RUN_TIMEOUT_S)


def _assert_same_steps(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert set(g) == set(r), set(g) ^ set(r)
        for key, v in r.items():
            if key.startswith(NOT_COMPARED):
                continue
            if isinstance(v, float) and not (math.isnan(v) and math.isnan(g[key])):
                assert g[key] == pytest.approx(v, rel=REL, abs=ABS), (r["step"], key, g[key], v)
            elif not isinstance(v, float):
                assert g[key] == v, (r["step"], key, g[key], v)


def _uneven(per_rank: list[dict], site: str) -> list[int]:
    """Steps where one rank brought work to `site` and another none."""
    counts: dict[int, list[int]] = {}
    for rank in per_rank:
        for step, s, mine, _ in rank["sites"]:
            if s == site:
                counts.setdefault(step, []).append(mine)
    return sorted(step for step, c in counts.items() if min(c) == 0 < max(c))


def test_exgrpo_at_ep2_with_unequal_ranks_equals_ep1(tmp_path, sft_cache_dir):
    """ExGRPO through warm-up, collecting and mixed steps (a validation at the end): replay scores, replayed rows'
    pi_old and validation with one rank empty; every logged number of every step equals EP=1's."""
    extra = ("trainer.total_steps=5", "trainer.val_every=5", "experience.delayed_start_pass_rate=0.05",
             "experience.ratio=0.5", "seed=11")
    ref = _run(tmp_path, sft_cache_dir, 1, extra)
    got = _run(tmp_path, sft_cache_dir, 2, extra)
    _assert_same_steps(got[0]["metrics"], ref[0]["metrics"])
    # warm-up, then collecting (the mixed-phase loss, nothing to replay yet), then mixed steps that replay
    phases = [(m["phase"], m["experience/n_replayed"] > 0) for m in got[0]["metrics"]]
    assert phases[0] == ("warmup", False) and ("mixed", False) in phases and phases[-1] == ("mixed", True), phases
    assert phases.index(("mixed", False)) < phases.index(("mixed", True)), phases
    assert "val/avg@1" in got[0]["metrics"][-1]
    # the unequal work really happened at EP=2, and every rank joined every pass
    assert _uneven(got, "replay_scores"), [r["sites"] for r in got]
    assert _uneven(got, "old_logprobs"), [r["sites"] for r in got]
    for rank in got:
        assert any(site == "idle_round" for _, site, _, _ in rank["sites"])  # joined another rank's generation
    assert [s[1:] for s in got[0]["sites"] if s[1] != "idle_round"] != [], "no pass recorded"
    assert [(s[0], s[1], s[3]) for s in got[0]["sites"] if s[1] != "idle_round"] == \
        [(s[0], s[1], s[3]) for s in got[1]["sites"] if s[1] != "idle_round"]  # same passes, same agreed counts


def test_dapo_at_ep2_with_a_rank_whose_groups_are_all_filtered_equals_ep1(tmp_path, sft_cache_dir):
    """DAPO's filter drops every fresh group of one rank: only that rank generates in the refill round(s) (the
    other joins with no prompt), then both train; every logged number equals EP=1's."""
    extra = ("algo.name=dapo", "trainer.total_steps=4", "trainer.val_every=0", "algo.max_refill_rounds=2",
             "seed=5")
    ref = _run(tmp_path, sft_cache_dir, 1, extra)
    got = _run(tmp_path, sft_cache_dir, 2, extra)
    _assert_same_steps(got[0]["metrics"], ref[0]["metrics"])
    assert any(m["filter/refill_rounds"] > 0 for m in got[0]["metrics"])

    def all_dropped(rewards: list[list[float]]) -> bool:
        return all(len(set(r)) == 1 for r in rewards)

    emptied = [(rank, step) for rank, r in enumerate(got) for step, rw in r["first_round_rewards"].items()
               if all_dropped(rw)]
    assert emptied, [r["first_round_rewards"] for r in got]
    refill = [(step, n) for r in got for step, n in r["rounds"]]
    assert any(n == 0 for _, n in refill), refill  # a rank with nothing to refill joined the other's round


def test_dp2_by_ep2_on_four_ranks_with_unequal_ranks_equals_ep1(tmp_path, sft_cache_dir):
    """Four ranks, two EP groups of two (DP=4 either way): the agreement spans both groups, so a pass that one
    group has no work for still joins the other's gradient sync; every logged number equals EP=1's."""
    extra = ("trainer.total_steps=4", "trainer.val_every=4", "data.num_val_examples=3", "trainer.train_batch_size=8",
             "trainer.ppo_mini_batch_size=4", "experience.delayed_start_pass_rate=0", "seed=11")
    ref = _run(tmp_path, sft_cache_dir, 1, extra, world=4)
    got = _run(tmp_path, sft_cache_dir, 2, extra, world=4)
    _assert_same_steps(got[0]["metrics"], ref[0]["metrics"])
    assert any(m["experience/n_replayed"] > 0 for m in got[0]["metrics"]) and "val/avg@1" in got[0]["metrics"][-1]
    assert _uneven(got, "replay_scores") or _uneven(got, "old_logprobs"), [r["sites"] for r in got]
    agreed = [[(s[0], s[1], s[3]) for s in r["sites"] if s[1] != "idle_round"] for r in got]
    assert all(a == agreed[0] for a in agreed)
