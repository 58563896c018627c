"""The replay recipes beside the paper's: the truncated-IS replay term against a float64 reference, the pool's
admission / retirement thresholds (the paper's and the authors' Megatron port's), the age bound and its exact
resume, `append` placement, the generation accounting, the experience settings' validation and the presets."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from exgrpo_megatron.algo.policy_loss import LossBatch, TruncatedISReplay
from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.schema import ExperienceConfig
from exgrpo_megatron.config.validate import config_errors
from exgrpo_megatron.data.datasets import DatasetStats, PromptDataset, PromptExample
from exgrpo_megatron.data.sampler import PromptSampler
from exgrpo_megatron.data.step_plan import compose_step, local_groups
from exgrpo_megatron.experience import GroupOutcome, ShardedExperiencePool
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.rollout.types import Sample
from exgrpo_megatron.training.step_metrics import generation_sums
from tests.test_algo_loss import random_batch, ref_token_loss, run_loss

K = 8
CAP = 1.5
PAPER = ExperienceConfig()  # admit 0 < k <= 7, retire at k > K - 1
SU01 = ExperienceConfig(ratio=0.25, admit_correct_above=0, admit_correct_at_most=1, retire_correct_above=4)


# ---------------------------------------------------------------- the truncated-IS replay term
def ref_tis_loss(b: dict, mixed: bool, mode: str, cap: float, t_max: int = 16) -> tuple[float, list[list[float]]]:
    """float64 token by token: fresh tokens as the paper's loss; replayed tokens u * (the fresh-token loss against
    pi_old), u = min(exp(old - recorded), cap). Also d loss / d logp per token (u * -A * rho on replayed tokens in the
    mixed phase, 0 where the warm-up clip binds)."""
    n_tok = int(b["mask"].sum())
    n_seq = int((b["mask"].sum(1) > 0).sum())
    norm = t_max * n_seq if mode == "token_sum_constant" else n_tok
    pg, ent = 0.0, 0.0
    grad = [[0.0] * b["lp"].shape[1] for _ in range(b["lp"].shape[0])]
    for i in range(b["lp"].shape[0]):
        adv = float(b["adv"][i])
        for t in range(b["lp"].shape[1]):
            if not b["mask"][i, t]:
                continue
            lp, old, beh = float(b["lp"][i, t]), float(b["old"][i, t]), float(b["beh"][i, t])
            loss_t, clipped = ref_token_loss(lp, old, beh, adv, False, mixed)  # the fresh formula
            u = min(math.exp(old - beh), cap) if b["replay"][i] else 1.0
            pg += u * loss_t
            grad[i][t] = 0.0 if clipped else u * -adv * math.exp(lp - old) / norm
            ent += float(b["ent"][i, t])
    return pg / norm - 0.001 * ent / n_tok, grad


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("mode", ["token_sum_constant", "token_mean"])
def test_replay_tis_term_matches_the_float64_reference(mixed, mode):
    for seed in range(3):
        b = random_batch(seed)
        b["lp"] = b["lp"].clone().requires_grad_(True)
        assert any(math.exp(float(o - r)) > CAP for o, r in zip(b["old"].flatten(), b["beh"].flatten(), strict=True))
        loss, metrics = run_loss(b, mixed, mode, policy_shaping=False, replay_tis_cap=CAP)
        want, want_grad = ref_tis_loss(b, mixed, mode, CAP)
        assert float(loss) == pytest.approx(want, rel=1e-12, abs=1e-14)
        (grad,) = torch.autograd.grad(loss, b["lp"])
        torch.testing.assert_close(grad * b["mask"], torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12,
                                   atol=1e-14)
        # the f(w) term on the same rows gives another loss: the option changes the replay term
        shaped, _ = run_loss(b, mixed, mode)
        assert abs(float(shaped) - want) > 1e-6
        assert float(metrics["replay_token_count"]) > 0


def test_replay_tis_cap_zero_is_the_shaped_term_bitwise():
    b = random_batch(4)
    a, _ = run_loss(b, True, "token_sum_constant")
    c, _ = run_loss(b, True, "token_sum_constant", replay_tis_cap=0.0)
    assert torch.equal(a, c)


@pytest.mark.parametrize("phase", [Phase.WARMUP, Phase.MIXED])
def test_exgrpo_selects_the_truncated_is_replay_term_by_its_cap(phase):
    """The algorithm's own loss (GroupRelative.loss over ExGRPO.replay_term) with algo.settings.replay_tis_cap > 0 is
    the float64 reference of the truncated-IS term, not the shaped one."""
    cfg = load_config("demo_cpu", ["algo.name=exgrpo", "algo.settings.policy_shaping=false",
                                   f"algo.settings.replay_tis_cap={CAP}", "algo.fresh_is_cap=0",
                                   "algo.entropy_coeff=0.001", "algo.clip_ratio=0.2",
                                   "algo.settings.replay_is_correction=true"])
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    assert isinstance(algorithm.replay_term, TruncatedISReplay)
    b = random_batch(7)
    batch = LossBatch.rows(b["lp"], b["ent"], b["mask"], old_logprobs=b["old"], behaviour_logprobs=b["beh"],
                           advantages=b["adv"], replay=b["replay"])
    n_tok, n_seq = float(b["mask"].sum()), float((b["mask"].sum(1) > 0).sum())
    loss, _ = algorithm.loss(batch, phase=phase, normalisers=(16 * n_seq, n_tok))
    want, _ = ref_tis_loss(b, phase is Phase.MIXED, "token_sum_constant", CAP)
    assert float(loss) == pytest.approx(want, rel=1e-12, abs=1e-14)


# ---------------------------------------------------------------- admission and retirement
def outcome(qid: int, k: int, step: int = 0, n: int | None = None) -> GroupOutcome:
    n = k if n is None else n
    return GroupOutcome(qid, k, K, [np.array([qid, step, j, 2], np.int32) for j in range(n)],
                        [np.full(4, -0.5, np.float32) for _ in range(n)], step=step)


def test_su01_thresholds_admit_only_one_of_k_and_retire_above_half():
    pool = ShardedExperiencePool(K, SU01)
    pool.update([outcome(1, 1), outcome(2, 2), outcome(3, 5), outcome(4, 4)])
    assert 1 in pool.shard and 2 not in pool.shard and 4 not in pool.shard  # 2 and 4 of 8 do not enter
    assert pool.retired_ids() == {3}  # 5 of 8 > K/2 retires, pool member or not
    pool.update([outcome(1, 3, step=1)])  # once in, a group of 3 of 8 moves it to bucket 3 and adds trajectories
    assert pool.shard.bucket_of(1) == 3 and len(pool.shard.candidates(1)) == 1 + 3
    pool.update([outcome(1, 0, step=2)])
    assert pool.shard.bucket_of(1) == 3  # all wrong: the stale bucket stays, as the original
    assert pool.update([outcome(1, 5, step=3)]) == [1] and 1 not in pool.shard


def test_paper_thresholds_admit_one_to_seven_and_retire_at_eight():
    pool = ShardedExperiencePool(K, PAPER)
    pool.update([outcome(q, q) for q in range(1, 8)] + [outcome(8, 8), outcome(9, 0)])
    assert sorted(pool.shard.question_ids()) == list(range(1, 8)) and pool.retired_ids() == {8}


def test_warm_up_outcomes_retire_without_storing():
    """Before the schedule collects, the algorithm reports k without trajectories: the pool retires by its own bound
    and stores nothing."""
    pool = ShardedExperiencePool(K, SU01)
    pool.update([outcome(1, 1, n=0), outcome(2, 6, n=0)])
    assert pool.shard.num_questions == 0 and pool.retired_ids() == {2}


# ---------------------------------------------------------------- the age bound
def _aged_pool(max_age: int) -> ShardedExperiencePool:
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random", max_age_steps=max_age))
    for step in range(1, 9):  # q <= 8 comes back every q % 4 + 1 steps, 9..12 only at step 1; one new trajectory each
        pool.update([outcome(q, 1 + (q + step) % 6, step=step, n=1) for q in range(1, 13)
                     if step == 1 or (q <= 8 and step % (q % 4 + 1) == 0)])
        pool.expire(step)
    return pool


def test_age_bound_evicts_old_trajectories_and_empties_buckets():
    a = 3
    pool = _aged_pool(a)
    ages = [9 - t.step for q in pool.shard.question_ids() for t in pool.shard.candidates(q)]
    assert ages and max(ages) <= a  # replayable at step 9: collected at step >= 9 - A
    unbounded = _aged_pool(0)
    assert unbounded.shard.num_trajectories > pool.shard.num_trajectories
    gone = set(unbounded.shard.question_ids()) - set(pool.shard.question_ids())
    assert gone and not gone & pool.retired_ids()  # left their buckets, not retired
    stats = pool.stats()
    assert stats["experience/questions"] == sum(stats[f"experience/bucket_{k}"] for k in range(K + 1))
    assert stats["experience/trajectories"] == len(ages)


def test_age_bound_resume_is_exact():
    """A pool restored from its state evicts and draws exactly as the uninterrupted one (the eviction order is a
    function of the saved state)."""
    a = 3
    live = _aged_pool(a)
    restored = ShardedExperiencePool(K, ExperienceConfig(metric="random", max_age_steps=a))
    restored.load_state_dict(live.state_dict())
    for step in range(9, 14):
        for pool in (live, restored):
            pool.update([outcome(q, 2, step=step, n=1) for q in range(20 + step, 22 + step)])
            pool.expire(step)
        draws = [[(c.qid, c.trajectory.token_ids.tolist()) for c in p.sample(6, rng_seed=step)]
                 for p in (live, restored)]
        assert draws[0] == draws[1]
        for k in range(K + 1):
            assert live.shard._buckets.members(k).tolist() == restored.shard._buckets.members(k).tolist()


# ---------------------------------------------------------------- placement
def _dataset(n: int) -> PromptDataset:
    return PromptDataset([PromptExample(q, f"q{q}", str(q), [1, q + 2]) for q in range(n)], DatasetStats(), [])


@pytest.mark.parametrize("placement", ["displace", "append"])
def test_append_keeps_the_fresh_batch_and_adds_the_replays(placement):
    b, rho = 8, 0.5
    pool = ShardedExperiencePool(K, ExperienceConfig(metric="random"))
    pool.update([outcome(q, 1 + q % 7, n=1) for q in range(100, 120)])
    data = _dataset(120)
    reference = PromptSampler(list(range(100)), seed=3).draw(b)
    groups = compose_step(data, PromptSampler(list(range(100)), seed=3), pool, replay_on=True, batch_size=b,
                          experience_ratio=rho, step_seed=5, scorer=None, placement=placement)
    fresh = [g.qid for g in groups if g.replay is None]
    replayed = [g.qid for g in groups if g.replay is not None]
    assert len(replayed) == int(rho * b)
    assert fresh == (reference if placement == "append" else reference[:b - len(replayed)])
    shares = [local_groups(groups, r, 2) for r in range(2)]  # DP = 2: every group on exactly one rank
    assert sorted(g.qid for s in shares for g in s) == sorted(g.qid for g in groups)
    assert min(len(s) for s in shares) >= b // 2


def test_generation_counts_skip_the_spliced_trajectory():
    def sample(n: int, replay: bool = False) -> Sample:
        return Sample([1], list(range(n)), [0.0] * n, "stop", is_replay=replay)

    fresh_group = [sample(3) for _ in range(K)]
    replay_group = [sample(5) for _ in range(K - 1)] + [sample(40, replay=True)]
    assert generation_sums([fresh_group, replay_group]) == {"generated_trajectories": 2 * K - 1.0,
                                                            "generated_tokens": 3.0 * K + 5 * (K - 1)}


# ---------------------------------------------------------------- config: validation, aliases, presets
@pytest.mark.parametrize("overrides, key", [
    (["experience.admit_correct_at_most=5", "experience.retire_correct_above=4"], "experience.admit_correct_at_most"),
    (["experience.retire_correct_above=8"], "experience.admit_correct_at_most"),
    (["experience.placement=front"], "experience.placement"),
    (["experience.max_age_steps=-1"], "experience.max_age_steps"),
])
def test_invalid_experience_settings_name_their_key(overrides, key):
    from exgrpo_megatron.config.validate import all_errors

    errors = all_errors(load_config("paper_ratio_cpu", overrides), 1, check_paths=False)
    assert any(e.startswith(key) for e in errors), errors


def test_truncated_is_replay_with_policy_shaping_is_refused_naming_the_cap():
    """ExGRPO's own relation (checked when the variant is built, as the training CLI does at start-up)."""
    from exgrpo_megatron.config.validate import ConfigError

    cfg = load_config("paper_ratio_cpu", ["algo.settings.replay_tis_cap=2"])  # policy shaping still on
    with pytest.raises(ConfigError) as err:
        build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    assert [e.split(":", 1)[0] for e in err.value.errors] == ["algo.settings.replay_tis_cap"]


def test_su01_preset_is_the_authors_recipe_beside_the_papers():
    su01, paper = load_config("exgrpo_su01"), load_config("exgrpo_7b")
    x = su01.experience
    assert (x.ratio, x.admit_correct_above, x.admit_correct_at_most, x.retire_above(su01.rollout.n)) == (0.25, 0, 1, 4)
    assert (su01.algo.settings["replay_tis_cap"], su01.algo.settings["policy_shaping"]) == (2.0, False)
    p = paper.experience
    assert (p.ratio, p.admit_correct_at_most, p.retire_above(paper.rollout.n), p.max_age_steps) == (0.5, 7, 7, 0)
    assert (su01.model, su01.trainer.train_batch_size, su01.optim) == (paper.model, paper.trainer.train_batch_size,
                                                                      paper.optim)
    assert config_errors(su01, world_size=8) == []


def test_append_preset_is_the_papers_recipe_with_replay_on_top():
    """conf/exgrpo_append.yaml changes only where replayed questions go and how many (docs/results.md's verdict)."""
    append, paper = load_config("exgrpo_append"), load_config("exgrpo_7b")
    assert (append.experience.placement, append.experience.ratio) == ("append", 0.25)
    assert paper.experience.placement == "displace"
    assert dataclasses.replace(append.experience, placement="displace", ratio=0.5) == paper.experience
    assert (append.model, append.algo, append.trainer, append.optim) == (paper.model, paper.algo, paper.trainer,
                                                                         paper.optim)
    assert config_errors(append, world_size=8) == []


def test_rescue_replay_preset_is_the_papers_setup_with_rescue_replay_instead_of_the_pool():
    """conf/rescue_replay.yaml changes only the algorithm (docs/results.md's data-scarce verdict): rescue replay with
    the measured truncated-IS cap, no experience pool, the paper's model, data, batch, optimizer and clip."""
    rescue, paper = load_config("rescue_replay"), load_config("exgrpo_7b")
    assert (rescue.algo.name, rescue.algo.settings) == ("rescue_replay", {"replay_tis_cap": 2.0})
    assert dataclasses.replace(rescue.algo, name=paper.algo.name, settings=paper.algo.settings) == paper.algo
    assert (rescue.model, rescue.data, rescue.trainer, rescue.optim, rescue.experience) == (
        paper.model, paper.data, paper.trainer, paper.optim, paper.experience)
    algorithm = build_algorithm(rescue.algo, rescue.trainer, rescue.data.max_response_length)
    assert not algorithm.uses_pool
    rule = algorithm.response_replay(rescue.experience)
    assert rule is not None and rule.rescue_only and rule.per_question == 1
    assert config_errors(rescue, world_size=8) == []
