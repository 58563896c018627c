"""The algorithm protocol: variants are found by name (algo/variants/) or by a package.module:Class path, an
unknown name stops the CLI with exit 2 naming algo.name, ExGRPO and GRPO implement the protocol with group-mean
advantages, and the group filter's refill decides the same on every data-parallel rank."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from exgrpo_megatron.algo.protocol import RLAlgorithm
from exgrpo_megatron.algo.registry import algorithm_class, build_algorithm, registered_names
from exgrpo_megatron.algo.variants.grpo import GRPO
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError
from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.rollout.group_filter import StepRollouts, filter_and_refill, refill_slices
from tests.helpers.multirank import run_on_ranks


@dataclass(frozen=True)
class HalfAdvantageGRPO(GRPO):
    """A variant outside the package (selected by its path): GRPO with halved advantages."""

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().advantages(rewards)


def _build(*overrides: str) -> RLAlgorithm:
    cfg = load_config("demo_cpu", list(overrides))
    return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)


def test_builtin_variants_are_registered_and_implement_the_protocol():
    assert {"exgrpo", "grpo"} <= set(registered_names())
    exgrpo, grpo = _build("algo.name=exgrpo"), _build("algo.name=grpo")
    assert isinstance(exgrpo, RLAlgorithm) and isinstance(grpo, RLAlgorithm)
    assert exgrpo.uses_pool and not grpo.uses_pool
    assert not exgrpo.filters_groups and not grpo.filters_groups


@pytest.mark.parametrize("name", ["exgrpo", "grpo"])
@pytest.mark.parametrize("std", [False, True])
def test_group_mean_advantages_equal_a_float64_reference(name, std):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    got = _build(f"algo.name={name}", f"algo.adv_std_normalize={str(std).lower()}").advantages(rewards)
    for g, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        sd = (sum((x - mean) ** 2 for x in row) / (len(row) - 1)) ** 0.5
        for i, r in enumerate(row):
            want = (r - mean) / (sd + 1e-6) if std else r - mean
            assert float(got[g, i]) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_a_class_path_selects_a_variant_outside_the_package():
    algo = _build(f"algo.name={__name__}:HalfAdvantageGRPO")
    assert type(algo) is HalfAdvantageGRPO and algo.name == f"{__name__}:HalfAdvantageGRPO"
    assert algo.advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64)).tolist() == [[0.25, -0.25]]


@pytest.mark.parametrize("name", ["ppo", "no_such_module:Cls", f"{__name__}:NoSuchClass", f"{__name__}:_build"])
def test_an_unknown_algorithm_names_the_key(name):
    with pytest.raises(ConfigError, match="algo.name"):
        _build(f"algo.name={name}")
    if ":" not in name:
        with pytest.raises(ValueError, match="expected one of"):
            algorithm_class(name)


def test_cli_exits_2_naming_algo_name():
    proc = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu",
                           "algo.name=ppo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "algo.name" in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------ the group filter's refill
def _rewards_of(qid: int) -> list[float]:
    """A group's rewards by question: every third question is all-correct (zero variance), the rest mixed."""
    return [1.0, 1.0, 1.0, 1.0] if qid % 3 == 0 else [1.0, 0.0, 1.0, 0.0]


def _zero_variance_kept(rewards: Sequence[float]) -> bool:
    return len(set(rewards)) > 1


def _refill_on_rank(first_qids_per_rank: list[list[int]], max_rounds: int, distributed: bool) -> dict:
    import torch.distributed as dist

    rank, size = 0, 1
    if distributed:
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    next_qid = [1000]
    drawn: list[list[int]] = []

    def group(q: int) -> QuestionGroup:
        return QuestionGroup(q, [1, 2], "1")

    def draw_fresh(n: int) -> list[QuestionGroup]:
        qids = list(range(next_qid[0], next_qid[0] + n))
        next_qid[0] += n
        drawn.append(qids)
        return [group(q) for q in qids]

    def generate_round(groups: list[QuestionGroup], refill_round: int):
        return [[] for _ in groups], [_rewards_of(g.qid) for g in groups]

    mine = [group(q) for q in first_qids_per_rank[rank]]
    first = StepRollouts.unfiltered(mine, [[] for _ in mine], [_rewards_of(g.qid) for g in mine])
    got = filter_and_refill(_zero_variance_kept, first, generate_round=generate_round, draw_fresh=draw_fresh,
                            max_rounds=max_rounds, dp_group=dist.group.WORLD if distributed else None,
                            dp_rank=rank, dp_size=size)
    return {"trained": [g.qid for g in got.groups], "graded": [g.qid for g in got.graded_groups],
            "dropped": got.dropped, "rounds": got.rounds, "drawn": drawn}


def test_refill_slices_cover_each_ranks_deficit():
    assert refill_slices([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]


def test_refill_on_one_rank_replaces_dropped_groups_with_fresh_ones():
    got = _refill_on_rank([[3, 1, 6, 2]], max_rounds=3, distributed=False)
    # 3 and 6 dropped; round 1 draws 1000, 1001 (1000 % 3 != 0 and 1001 % 3 != 0: both kept)
    assert got["trained"] == [1, 2, 1000, 1001] and got["rounds"] == 1 and got["dropped"] == 2
    assert got["graded"] == [3, 1, 6, 2, 1000, 1001]


def test_refill_stops_at_the_cap():
    got = _refill_on_rank([[3, 1, 6, 2]], max_rounds=0, distributed=False)
    assert got["trained"] == [1, 2] and got["rounds"] == 0 and got["graded"] == [3, 1, 6, 2]


def test_two_ranks_decide_the_same_refill():
    # rank 0 drops 3 of 4, rank 1 drops none: only rank 0 gets fresh groups; the draws are identical on both ranks
    got = run_on_ranks(_refill_on_rank, 2, args=([[3, 6, 9, 1], [1, 2, 4, 5]], 4, True))
    assert got[0]["drawn"] == got[1]["drawn"] and got[0]["rounds"] == got[1]["rounds"]
    assert len(got[0]["trained"]) == len(got[1]["trained"]) == 4
    assert got[1]["trained"] == [1, 2, 4, 5] and got[1]["graded"] == [1, 2, 4, 5]
    # round 1 draws 1000..1002 (1002 dropped), round 2 draws 1003 (kept)
    assert got[0]["drawn"] == [[1000, 1001, 1002], [1003]]
    assert got[0]["trained"] == [1, 1000, 1001, 1003] and got[0]["dropped"] == got[1]["dropped"] == 4


def test_two_ranks_short_at_the_cap_train_the_same_number_of_groups():
    got = run_on_ranks(_refill_on_rank, 2, args=([[3, 6, 9, 1], [1, 2, 4, 5]], 0, True))
    assert got[0]["trained"] == [1] and got[1]["trained"] == [1]  # the smallest kept count, on every rank
    assert got[1]["graded"] == [1, 2, 4, 5] and got[0]["dropped"] == 6
