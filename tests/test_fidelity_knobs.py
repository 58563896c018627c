"""The paper's ablation knobs as config values, each checked for the behaviour it names:
question selection (Gaussian vs uniform buckets, mu, sigma), trajectory selection (lowest / highest entropy,
random), policy shaping on/off, IS correction on/off, rho."""

from __future__ import annotations

import gzip
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from exgrpo_megatron.algo.loss import select_replay_denominator_logprobs
from exgrpo_megatron.algo.policy_loss import LossBatch
from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import config_errors
from exgrpo_megatron.data.step_plan import experience_quota
from exgrpo_megatron.experience import CandidateScores, GroupOutcome, ShardedExperiencePool
from exgrpo_megatron.training.components import build_pool
from tests.helpers.exgrpo_loss import exgrpo_loss

K = 8
QUESTIONS_PER_BUCKET = 200


def gaussian_rates(mu: float, sigma: float, buckets=range(1, K)) -> dict[int, float]:
    """Independent reference: p_k = exp(-(k - mu K)^2 / 2 sigma^2) normalised over the filled buckets."""
    w = {k: math.exp(-((k - mu * K) ** 2) / (2 * sigma**2)) for k in buckets}
    total = sum(w.values())
    return {k: v / total for k, v in w.items()}


def filled_pool(cfg_overrides: list[str], trajectories_per_question: int = 1) -> ShardedExperiencePool:
    """A pool built from the fidelity preset's config, with QUESTIONS_PER_BUCKET questions in each bucket 1..7."""
    cfg = load_config("fidelity_cpu", cfg_overrides)
    assert build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length).uses_pool
    pool = build_pool(cfg.experience, cfg.rollout.n)
    outcomes = []
    for k in range(1, K):
        for j in range(QUESTIONS_PER_BUCKET):
            qid = k * 1000 + j
            n = min(k, trajectories_per_question)
            outcomes.append(GroupOutcome(qid, k, K, [np.array([qid, c, 2], np.int32) for c in range(n)],
                                         [np.full(3, -0.5, np.float32) for _ in range(n)], step=1))
    pool.update(outcomes)
    return pool


def drawn_bucket_frequencies(pool: ShardedExperiencePool, draws: int = 300, n: int = 16) -> dict[int, float]:
    counts = np.zeros(K + 1)
    for seed in range(draws):
        for choice in pool.sample(n, rng_seed=seed):
            counts[choice.bucket] += 1
    return {k: counts[k] / counts.sum() for k in range(K + 1)}


@pytest.mark.parametrize("mu,sigma", [(0.5, 1.0), (0.25, 1.0), (0.5, 0.5), (0.5, 1.5)])
def test_gaussian_question_selection_draws_buckets_at_the_gaussian_rates(mu, sigma):
    pool = filled_pool([f"experience.bucket_mu={mu}", f"experience.bucket_sigma={sigma}"])
    freq = drawn_bucket_frequencies(pool)
    expected = gaussian_rates(mu, sigma)
    for k in range(1, K):
        assert freq[k] == pytest.approx(expected[k], abs=0.02), (k, freq, expected)
    if (mu, sigma) == (0.5, 1.0):  # the paper's setting: the middle three buckets take 88% of the draws
        assert freq[3] + freq[4] + freq[5] == pytest.approx(0.883, abs=0.02)


def test_uniform_question_selection_draws_buckets_uniformly():
    freq = drawn_bucket_frequencies(filled_pool(["experience.bucket_manager=uniform"]))
    for k in range(1, K):
        assert freq[k] == pytest.approx(1 / 7, abs=0.02), freq


def entropy_scorer(qids, candidates):
    """Mean entropy of a candidate = its second token id (0, 1, 2, ...): a known order to select from."""
    return [CandidateScores(mean_entropy=np.array([float(t.token_ids[1]) for t in cands])) for cands in candidates]


@pytest.mark.parametrize("mode,expected", [("argmin", 0), ("argmax", None)])
def test_trajectory_selection_lowest_and_highest_entropy(mode, expected):
    pool = filled_pool([f"experience.select_mode={mode}"], trajectories_per_question=8)
    choices = pool.sample(64, rng_seed=3, scorer=entropy_scorer)
    assert len(choices) == 64
    for c in choices:
        n_candidates = min(c.bucket, 8)
        want = 0 if expected == 0 else n_candidates - 1
        assert int(c.trajectory.token_ids[1]) == want, (mode, c.bucket)


def test_random_trajectory_selection_is_uniform_and_ignores_the_scorer():
    pool = filled_pool(["experience.metric=random", "experience.bucket_manager=uniform"], trajectories_per_question=8)

    def no_scorer(qids, candidates):
        raise AssertionError("random selection must not score")

    picks = [int(c.trajectory.token_ids[1]) for seed in range(200)
             for c in pool.sample(32, rng_seed=seed, scorer=no_scorer) if c.bucket == 7]
    freq = np.bincount(picks, minlength=7) / len(picks)
    np.testing.assert_allclose(freq, np.full(7, 1 / 7), atol=0.04)


def replay_grad(policy_shaping: bool, log_w: float, adv: float) -> float:
    lp = torch.tensor([[log_w]], dtype=torch.float64, requires_grad=True)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    loss, _ = exgrpo_loss(lp, zero, zero, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool),
                          torch.tensor([True]), None, mixed_phase=True, policy_shaping=policy_shaping,
                          pg_normaliser=1.0, entropy_normaliser=1.0)
    return float(torch.autograd.grad(loss, lp)[0])


@pytest.mark.parametrize("log_w", [-3.0, math.log(0.1), 0.0, 2.0])
def test_policy_shaping_switch(log_w):
    """On: d(-A f(w))/dlogp = -A beta w / (w + beta)^2 (bounded); off: the plain IS gradient -A w."""
    w, adv, beta = math.exp(log_w), 0.75, 0.1
    assert replay_grad(True, log_w, adv) == pytest.approx(-adv * beta * w / (w + beta) ** 2, rel=1e-12)
    assert replay_grad(False, log_w, adv) == pytest.approx(-adv * w, rel=1e-12)


def test_is_correction_switch_picks_recorded_or_current_old_logprobs():
    old = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]])
    recorded = torch.tensor([[-3.0, -4.0], [-3.5, -2.5]])
    replay = torch.tensor([True, False])
    on = select_replay_denominator_logprobs(old, recorded, replay, replay_is_correction=True)
    torch.testing.assert_close(on, torch.tensor([[-3.0, -4.0], [-1.5, -0.5]]))
    off = select_replay_denominator_logprobs(old, recorded, replay, replay_is_correction=False)
    torch.testing.assert_close(off, old)


@pytest.mark.parametrize("rho,expected", [(0.25, 16), (0.5, 32), (0.75, 48)])
def test_rho_sets_the_replayed_share_of_the_batch(rho, expected):
    cfg = load_config("fidelity_cpu", [f"experience.ratio={rho}"])
    quota = experience_quota(cfg.trainer.train_batch_size, cfg.experience.ratio)
    assert quota == expected
    pool = filled_pool([f"experience.ratio={rho}"])
    assert len(pool.sample(quota, rng_seed=0)) == expected  # the pool holds more: n_exp = min(quota, |E|)
    assert len(filled_pool([]).sample(10_000, rng_seed=0)) == 7 * QUESTIONS_PER_BUCKET


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "bench" / "exgrpo_vs_grpo.py"
    spec = importlib.util.spec_from_file_location("exgrpo_vs_grpo", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["fidelity_cpu", "paper_ratio_cpu"])
def test_every_bench_variant_is_a_valid_config_override(preset):
    bench = _bench_module()
    variants = {**bench.ARMS, **bench.ABLATIONS, **bench.DIAGNOSES, **bench.WEAK_START, **bench.RECIPES,
                **bench.WEAK_RECIPES}
    for name, overrides in variants.items():
        cfg = load_config(preset, overrides)
        assert config_errors(cfg, world_size=1) == [], name
        if name not in ("exgrpo", "exgrpo_same_code"):  # the same-code rerun of an arm is that arm
            assert cfg != load_config(preset), f"{name} changes nothing"


def test_paper_ratio_preset_mirrors_the_paper_ratios():
    """>= 300 distinct training questions per batch slot (paper 46k / 128 = 360); ExGRPO's fresh draws cover the
    training set about once and GRPO's about twice; 2 updates per step; one pinned precision."""
    cfg = load_config("paper_ratio_cpu")
    t, d = cfg.trainer, cfg.data
    assert d.num_train_examples / t.train_batch_size >= 300
    grpo_epochs = t.total_steps * t.train_batch_size / d.num_train_examples
    exgrpo_epochs = t.total_steps * t.train_batch_size * (1 - cfg.experience.ratio) / d.num_train_examples
    assert 1.8 <= grpo_epochs <= 2.2 and 0.9 <= exgrpo_epochs <= 1.1
    assert t.train_batch_size // t.ppo_mini_batch_size == 2 and cfg.rollout.n == 8
    assert cfg.experience.delayed_start_pass_rate == 0.35 and cfg.model.params_dtype == "fp32"
    assert cfg.algo.entropy_microbatches_ref == 4 and cfg.algo.loss_seqs_per_rank_ref == 64


def test_bench_plan_reuses_sweep_runs_and_skips_finished_ones(tmp_path):
    bench = _bench_module()
    args = bench.parse(["--protocol", "fidelity", "--root", str(tmp_path / "runs"), "--records",
                        str(tmp_path / "records"), "--phase", "sweep", "final", "ablation", "stability", "diagnosis",
                        "--sweep-seeds", "1", "2"])
    best = {"exgrpo": 5e-5, "grpo": 1e-4}
    runs = bench.plan_runs(args, best)
    dirs = [r.run_dir for r in runs]
    assert len(dirs) == len(set(dirs))
    by_phase = {p: [r for r in runs if r.phase == p] for p in bench.PHASES}
    assert len(by_phase["sweep"]) == 2 * len(args.lrs) * len(args.sweep_seeds)
    # final seeds already run by the sweep at the chosen rate are reused, not planned twice
    assert len(by_phase["final"]) == 2 * len(set(args.seeds) - set(args.sweep_seeds))
    assert len(by_phase["ablation"]) == len(bench.ABLATIONS) * len(args.ablation_seeds)
    assert all(r.lr == best["exgrpo"] for r in by_phase["ablation"])
    assert {r.lr for r in by_phase["stability"]} == {max(args.lrs) * args.stability_lr_factor}
    assert {r.lr for r in by_phase["diagnosis"]} == {best["grpo"], max(args.lrs) * args.stability_lr_factor}
    assert len(by_phase["diagnosis"]) == 2 * len(bench.DIAGNOSES) * len(args.ablation_seeds)
    run = by_phase["final"][0]
    assert not run.done
    Path(run.run_dir).mkdir(parents=True)
    for name in bench.RECORD_FILES:
        (Path(run.run_dir) / name).write_text(name)
    assert not run.done  # finished, but its record is not kept yet
    run.keep_record()
    assert run.done  # a run with a committed record is not re-run (in any later checkout)
    kept = tmp_path / "records" / Path(run.run_dir).name
    assert gzip.decompress((kept / "metrics.jsonl.gz").read_bytes()) == b"metrics.jsonl"  # kept compressed
    assert (kept / "config.yaml").read_text() == "config.yaml" and not (kept / "metrics.jsonl").exists()
    high_lr_diagnosis = [r for r in by_phase["diagnosis"] if r.lr != best["grpo"]]  # needs no learning-rate choice
    assert bench.plan_runs(args, {"exgrpo": None, "grpo": None}) == (by_phase["sweep"] + by_phase["stability"]
                                                                      + high_lr_diagnosis)
    args.variants = ["rho_0.25", "rho_0.75"]  # --variants: only those runs of the phases
    assert bench.plan_runs(args, best) == [r for r in by_phase["ablation"] if r.variant.startswith("rho_")]
    assert len(bench.plan_runs(args, best)) == 2 * len(args.ablation_seeds)


def test_weak_start_runs_use_each_arms_rate_and_their_own_warm_start(tmp_path):
    bench = _bench_module()
    args = bench.parse(["--root", str(tmp_path / "runs"), "--records", str(tmp_path / "records")])
    assert args.config_name == "paper_ratio_cpu" and len(args.lrs) >= 4
    best = {"exgrpo": 5e-5, "grpo": 1e-4}
    weak = [r for r in bench.plan_runs(args, best) if r.phase == "weak_start"]
    assert {(r.variant, r.lr) for r in weak} == {("weak_exgrpo", 5e-5), ("weak_grpo", 1e-4)}
    assert len(weak) == 2 * len(args.seeds)
    normal = bench.Run("final", "exgrpo", 5e-5, 1, "x", "y")
    weak_exgrpo, weak_grpo = (next(r for r in weak if r.seed == 1 and r.variant == v) for v in WEAK_ARMS)
    # the weak start is a different (shorter) warm start, shared by the two arms of a seed
    assert bench.warm_start_ready(args, weak_exgrpo) == bench.warm_start_ready(args, weak_grpo)
    assert bench.warm_start_ready(args, weak_exgrpo) != bench.warm_start_ready(args, normal)
    assert "--weights" in bench.eval_argv(args, weak_exgrpo) and "--weights" not in bench.eval_argv(args, normal)


WEAK_ARMS = ("weak_exgrpo", "weak_grpo")


def test_recipe_runs_take_their_algorithms_rate_and_weak_ones_the_weak_start(tmp_path):
    bench = _bench_module()
    args = bench.parse(["--root", str(tmp_path / "runs"), "--records", str(tmp_path / "records"), "--phase",
                        "recipes"])
    best = {"exgrpo": 5e-5, "grpo": 1e-4}
    runs = bench.plan_runs(args, best)
    assert len(runs) == (len(bench.RECIPES) + len(bench.WEAK_RECIPES)) * len(args.seeds) >= 10 * 5
    on_policy = [r.variant.removeprefix("weak_").startswith("grpo") for r in runs]
    assert {r.variant for r, grpo in zip(runs, on_policy, strict=True) if grpo} == {
        "grpo_b12", "grpo_b10", "grpo_same_code", "weak_grpo_same_code"}
    assert {(r.lr, grpo) for r, grpo in zip(runs, on_policy, strict=True)} == {(1e-4, True), (5e-5, False)}
    weak = next(r for r in runs if r.variant == "weak_su01" and r.seed == 1)
    assert "--weights" in bench.eval_argv(args, weak)  # its warm start is evaluated too
    same_start = bench.Run("weak_start", "weak_exgrpo", 5e-5, 1, "x", "y")
    assert bench.warm_start_ready(args, weak) == bench.warm_start_ready(args, same_start)
    assert bench.plan_runs(args, {"exgrpo": None, "grpo": None}) == []  # they wait for the rate choice
    for name, matched in bench.MATCHED_GRPO.items():  # the larger GRPO batch generates about what append does
        cfg = load_config("paper_ratio_cpu", bench.RECIPES[name])
        b, k = cfg.trainer.train_batch_size, cfg.rollout.n
        append_per_step = b * k + int(cfg.experience.ratio * b) * (k - 1)
        grpo_per_step = load_config("paper_ratio_cpu", bench.RECIPES[matched]).trainer.train_batch_size * k
        assert abs(grpo_per_step - append_per_step) <= k // 2, name


def test_weak_start_verdict_counts_collapses_and_the_rate_choice_is_marked_interior(tmp_path):
    fa = _bench_module().fa

    def run(start: float, final: float, fresh_tail: float) -> dict:
        return {"test": {"greedy": final, "avg@8_T0.6": final, "avg@8_T1": final},
                "start": {"greedy": start, "avg@8_T0.6": start, "avg@8_T1": start},
                "steps": list(range(1, 21)), "reward/fresh_mean": [0.1] * 18 + [fresh_tail] * 2}

    assert fa.collapsed(run(0.2, 0.1, 0.1))  # ended below its start
    assert fa.collapsed(run(0.2, 0.3, 0.0))  # fresh reward 0 over the last 10% of steps
    assert not fa.collapsed(run(0.2, 0.3, 0.1))
    # interior: neither end of the grid (a choice at an end means the optimum was not located)
    grid = [5e-5, 1e-4, 2e-4]
    assert fa.choose_rate({5e-5: 0.1, 1e-4: 0.9, 2e-4: 0.2}, grid) == {
        "lr": 1e-4, "val_by_lr": {5e-5: 0.1, 1e-4: 0.9, 2e-4: 0.2}, "interior": True}
    assert fa.choose_rate({5e-5: 0.1, 1e-4: 0.2, 2e-4: 0.9}, grid)["interior"] is False
    assert fa.choose_rate({5e-5: 0.9, 1e-4: 0.2, 2e-4: 0.1}, grid)["interior"] is False
    assert fa.choose_rate({5e-5: 0.1, 1e-4: 0.9}, grid) is None  # the sweep has not finished


def test_paired_difference_is_the_per_seed_mean_with_a_t_interval():
    """The headline statistic: (a - b) per seed (runs of a seed share their warm start), mean +- t * s / sqrt(n),
    over the seeds both arms finished; an independent float64 reference."""
    fa = _bench_module().fa

    def run(greedy: float, val: float) -> dict:
        return {"test": {"greedy": greedy, "avg@8_T0.6": greedy / 2, "avg@8_T1": greedy / 4},
                "val": [(100, 0.0, val)], "steps": [100], "total_steps": 100}

    a = {1: run(0.60, 0.5), 2: run(0.40, 0.4), 3: run(0.75, 0.7), 4: run(0.9, 0.9)}
    b = {1: run(0.62, 0.6), 2: run(0.43, 0.3), 3: run(0.76, 0.7), 5: run(0.1, 0.1)}  # seeds 4, 5 unpaired
    out = fa.paired_difference(a, b)
    diffs = np.array([-0.02, -0.03, -0.01])
    half = 4.303 * diffs.std(ddof=1) / math.sqrt(3)  # t_{0.975, 2}
    assert out["seeds"] == [1, 2, 3]
    assert out["greedy"]["n"] == 3
    assert out["greedy"]["mean"] == pytest.approx(diffs.mean(), abs=1e-12)
    assert out["greedy"]["ci95"] == pytest.approx(half, abs=1e-12)
    assert out["avg@8_T1"]["mean"] == pytest.approx(diffs.mean() / 4, abs=1e-12)
    assert out["final_val"]["mean"] == pytest.approx(np.mean([-0.1, 0.1, 0.0]), abs=1e-12)


@pytest.mark.parametrize("clip", [False, True])
def test_mixed_phase_clip_switch(clip):
    """algo.settings.mixed_phase_clip (issue-15 diagnostic), through Algorithm.loss: a fresh token whose ratio is past
    1 + eps with A > 0 gets the plain gradient -A rho in the paper's unclipped mixed phase and none when clipped;
    the replayed token's f(w) gradient is the same either way; the warm-up phase clips in both settings."""
    from exgrpo_megatron.experience.schedule import Phase

    cfg = load_config("fidelity_cpu", [f"algo.settings.mixed_phase_clip={str(clip).lower()}"])
    algo = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    old = torch.tensor([[-1.0], [-1.0]], dtype=torch.float64)
    log_rho, log_w, adv = 0.5, 0.3, 0.75  # rho = e^0.5 > 1.2: outside the clip range
    replay = torch.tensor([False, True])

    def grads(phase: Phase) -> list[float]:
        lp = (old + torch.tensor([[log_rho], [log_w]], dtype=torch.float64)).requires_grad_()
        batch = LossBatch.rows(lp, None, torch.ones(2, 1, dtype=torch.float64), old_logprobs=old,
                               behaviour_logprobs=old, advantages=torch.tensor([adv, adv], dtype=torch.float64),
                               replay=replay)
        loss, _ = algo.loss(batch, phase=phase, normalisers=(1.0, 1.0))
        return torch.autograd.grad(loss, lp)[0].flatten().tolist()

    w, beta = math.exp(log_w), algo.shaping_beta
    mixed_fresh, mixed_replay = grads(Phase.MIXED)
    assert mixed_fresh == pytest.approx(0.0 if clip else -adv * math.exp(log_rho), abs=1e-12)
    assert mixed_replay == pytest.approx(-adv * beta * w / (w + beta) ** 2, rel=1e-12)
    assert grads(Phase.WARMUP)[0] == pytest.approx(0.0, abs=1e-12)
    assert algo.clips(Phase.MIXED) is clip
