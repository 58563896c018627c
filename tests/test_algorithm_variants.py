"""The variants beyond ExGRPO and GRPO, each one file in algo/variants/ selected by `algo.name`: their advantages,
filters and losses against float64 references, and short training runs of a tiny warm-started model that use them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from exgrpo_megatron.algo.policy_loss import LossBatch
from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.algo.variants.dapo import DAPO
from exgrpo_megatron.algo.variants.exgrpo import ExGRPO
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.training.step_observer import StepObserver
from tests.helpers.demo_digest import overrides, warm_start
from tests.helpers.multirank import run_on_ranks


def _build(name: str):
    cfg = load_config("demo_cpu", [f"algo.name={name}"])
    return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)


def _ppo_clip_reference(logp, old, adv, mask, eps: float, normaliser: float) -> float:
    """float64 sum over valid tokens of max(-A rho, -A clip(rho, 1-eps, 1+eps)) / normaliser."""
    total = 0.0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                rho = float(torch.exp(logp[b, t] - old[b, t]))
                total += max(-adv[b] * rho, -adv[b] * min(max(rho, 1 - eps), 1 + eps))
    return total / normaliser


def _rloo_reference(rewards: list[float]) -> list[float]:
    k = len(rewards)
    return [r - sum(x for j, x in enumerate(rewards) if j != i) / (k - 1) for i, r in enumerate(rewards)]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, sft_cache_dir) -> str:
    unused = str(tmp_path_factory.mktemp("unused"))
    run_on_ranks(warm_start, 1, args=(overrides(unused, sft_cache_dir, ("trainer.micro_batch_max_tokens=8192",)),))
    return sft_cache_dir


class _Recorder(StepObserver):
    """Each step's trained rewards / advantages and the graded groups (kept or dropped by the filter)."""

    def __init__(self) -> None:
        self.rec: dict = {"batches": [], "graded": []}

    def started(self, c) -> None:
        self.rec["c"] = c

    def rolled_out(self, step, rollouts) -> None:
        self.rec["graded"].append([(g.qid, r) for g, r in zip(rollouts.graded_groups, rollouts.graded_rewards,
                                                               strict=True)])
        self.rewards = rollouts.rewards

    def rows_built(self, step, rows) -> None:
        self.rec["batches"].append({"rewards": self.rewards, "advantages": rows.advantages,
                                    "group_index": rows.group_index})


def _train_recording(overrides_: list[str]) -> dict:
    """run_training on this rank, recording each step's trained rewards / advantages and the graded groups."""
    from exgrpo_megatron.training.trainer import run_training

    recorder = _Recorder()
    cfg = load_config("demo_cpu", overrides_)
    assert run_training(cfg, observers=[recorder]) == 0
    rec = recorder.rec
    c = rec.pop("c")
    rec["retired"] = sorted(c.pool.shard.retired) if c.pool is not None else None
    if c.layout.rank == 0:
        with open(os.path.join(cfg.logging.run_dir, "metrics.jsonl")) as f:
            rec["metrics"] = [json.loads(line) for line in f]
    return rec


# ------------------------------------------------------------------------------------------------------- RLOO
def test_rloo_advantages_equal_the_leave_one_out_reference():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.25, 1.0]], dtype=torch.float64)
    got = _build("rloo").advantages(rewards)
    for g, row in enumerate(rewards.tolist()):
        assert got[g].tolist() == pytest.approx(_rloo_reference(row), rel=1e-12, abs=1e-15)


def test_rloo_loss_equals_the_ppo_clip_reference():
    algo = _build("rloo")
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    logp = old + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = algo.advantages(torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64))[0]
    batch = LossBatch.rows(logp, None, mask, old_logprobs=old, behaviour_logprobs=old, advantages=adv,
                           replay=torch.zeros(3))
    loss, metrics = algo.loss(batch, phase=Phase.WARMUP, normalisers=(7.0, 9.0))
    ref = _ppo_clip_reference(logp, old, adv.tolist(), mask, algo.surrogate.clip.low, 7.0)
    assert float(loss) == pytest.approx(ref, rel=1e-12) and float(metrics["pg_loss"]) == pytest.approx(ref, rel=1e-12)


def test_training_with_rloo_uses_its_advantages(tmp_path, sft_dir):
    rec = run_on_ranks(_train_recording, 1, args=(overrides(str(tmp_path / "rloo"), sft_dir,
                                                            ("algo.name=rloo", "trainer.total_steps=2")),))[0]
    informative = 0
    for batch in rec["batches"]:
        want = [a for row in batch["rewards"] for a in _rloo_reference(row)]
        assert batch["advantages"] == pytest.approx(want, rel=1e-12, abs=1e-15)
        informative += sum(len(set(row)) > 1 for row in batch["rewards"])
    assert informative > 0 and [m["phase"] for m in rec["metrics"]] == ["warmup", "warmup"]


# ------------------------------------------------------------------------------------------------------- DAPO
@dataclass(frozen=True)
class ExGRPOWithDynamicSampling(ExGRPO):
    """ExGRPO with DAPO's filter, selected by its path: the filter with an experience pool."""

    filters_groups = True
    keep_group = DAPO.keep_group


def test_dapo_keeps_exactly_the_groups_with_unequal_rewards():
    algo = _build("dapo")
    assert algo.filters_groups
    for rewards in ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]):
        assert algo.keep_group(rewards) is (max(rewards) != min(rewards))


def test_training_with_dapo_trains_only_informative_groups(tmp_path, sft_dir):
    rec = run_on_ranks(_train_recording, 1, args=(overrides(str(tmp_path / "dapo"), sft_dir,
                                                            ("algo.name=dapo", "trainer.total_steps=2")),))[0]
    for batch, graded, m in zip(rec["batches"], rec["graded"], rec["metrics"], strict=True):
        assert all(len(set(row)) > 1 for row in batch["rewards"])
        n_uninformative = sum(len(set(r)) == 1 for _, r in graded)
        assert m["filter/dropped_groups"] == len(graded) - len(batch["rewards"]) >= n_uninformative > 0
        assert len(batch["rewards"]) == 16 or m["filter/refill_rounds"] == 3  # refilled to B, or the cap was hit


def test_dynamic_sampling_on_two_ranks_with_the_pool(tmp_path, sft_dir):
    name = f"{__name__}:ExGRPOWithDynamicSampling"
    got = run_on_ranks(_train_recording, 2, args=(overrides(str(tmp_path / "exgrpo_ds"), sft_dir,
                                                            (f"algo.name={name}", "trainer.total_steps=3")),))
    metrics = got[0]["metrics"]
    assert sum(m["filter/dropped_groups"] for m in metrics) > 0 and sum(m["experience/n_replayed"] for m in metrics) > 0
    for step in range(3):
        sizes = [len(r["batches"][step]["rewards"]) for r in got]
        assert sizes[0] == sizes[1]  # every rank trains the same number of groups
        assert all(len(set(row)) > 1 for r in got for row in r["batches"][step]["rewards"])
    # every graded group reached the pool, trained or dropped: the retired questions are exactly those solved K of K
    solved = {qid for r in got for step in r["graded"] for qid, rewards in step if min(rewards) == 1.0}
    assert solved and got[0]["retired"] == got[1]["retired"] == sorted(solved)
