"""The step's metrics from what each verb measured: the rows' sums, the skip count, and the one reduction over
data-parallel ranks -- the same step split over DP=2 ranks (each with half the groups) reports exactly what one
rank with every group reports (dyadic values, so every sum is exact in any order)."""

from __future__ import annotations

import torch

from exgrpo_megatron.algo.loss_metrics import metric_reduce_op
from exgrpo_megatron.policy.policy import UpdateResult
from exgrpo_megatron.policy.train_batch import RolloutRows
from exgrpo_megatron.training.step_metrics import (
    TrainMetrics,
    UpdateMetrics,
    consecutive_skips_after,
    dp_reduce,
    local_totals,
    rollout_sums,
    step_summary,
)
from tests.helpers.multirank import run_on_ranks

N_GROUPS, K = 4, 2
# Group g's rows: rewards, response lengths, replayed? (group 3 holds a replayed trajectory)
REWARDS = [[1.0, 0.0], [0.5, 0.25], [0.0, 0.0], [1.0, 0.75]]
LENGTHS = [[3, 5], [2, 2], [7, 1], [4, 6]]
REPLAY = [[False, False], [False, False], [False, False], [False, True]]
PROMPT = 2


def _rows(groups: list[int]) -> RolloutRows:
    rows = [(g, k) for g in groups for k in range(K)]
    return RolloutRows(
        sequences=[[1] * (PROMPT + LENGTHS[g][k]) for g, k in rows], prompt_lengths=[PROMPT] * len(rows),
        behaviour_logprobs=[torch.zeros(LENGTHS[g][k]) for g, k in rows],
        rewards=[REWARDS[g][k] for g, k in rows], advantages=[0.0] * len(rows),
        is_replay=[REPLAY[g][k] for g, k in rows], group_index=[i for i, _ in enumerate(groups) for _ in range(K)])


def _micro(g: int) -> dict[str, float]:
    """Group g's loss metrics in one micro-batch: sums, and a max-reduced key (the largest in group 2)."""
    return {"pg_loss": 0.125 * (g + 1), "token_count": float(sum(LENGTHS[g])), "replay_weight_max": [0.5, 0.25,
            2.0, 0.75][g]}


def _trained(groups: list[int]) -> TrainMetrics:
    """Two updates over halves of `groups`, one micro-batch per group; the first update measured the mismatch."""
    halves = [groups[: len(groups) // 2], groups[len(groups) // 2:]]
    updates = tuple(UpdateMetrics(UpdateResult(grad_norm=1.5 + u, skipped=u == 1, lr=1e-3),
                                  tuple(_micro(g) for g in half), (1.0 * len(half), 0.5 * len(half)) if u == 0
                                  else (0.0, 0.0)) for u, half in enumerate(halves))
    return TrainMetrics(rollout_sums(_rows(groups)), (0.25 * len(groups), 4.0 * len(groups)), updates,
                        forward_rows=len(groups))


def _step_metrics(distributed: bool) -> dict[str, float]:
    """This rank's groups (DP=2: every other one), its metrics reduced over the ranks."""
    import torch.distributed as dist

    rank, size = 0, 1
    if distributed:
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    trained = _trained(list(range(N_GROUPS))[rank::size])
    reduced = dp_reduce(local_totals(trained, grader_deaths=rank + 1, reduce_op=metric_reduce_op),
                        dist.group.WORLD if distributed else None)
    out = step_summary(reduced, trained.updates, lambda loss: {f"loss/{k}": v for k, v in loss.items()})
    return {**out, "old_logprobs/forward_rows": reduced.sums["forward_rows"]}


def test_rollout_sums_of_the_rows():
    assert rollout_sums(_rows([1, 3])) == {
        "reward_sum": 2.5, "reward_n": 4.0, "fresh_sum": 1.75, "fresh_n": 3.0, "replay_sum": 0.75, "replay_n": 1.0,
        "length_sum": 14.0, "tokens": 22.0}


def test_consecutive_skips_count_on_and_reset():
    assert consecutive_skips_after(2, [True, True]) == 4
    assert consecutive_skips_after(2, [True, False]) == 0
    assert consecutive_skips_after(2, [False, True]) == 1
    assert consecutive_skips_after(3, []) == 3


def test_one_rank_metrics():
    got = _step_metrics(distributed=False)
    assert got["reward/mean"] == 3.5 / 8 and got["reward/replay_mean"] == 0.75
    assert got["response_length/mean"] == 30 / 8 and got["old_logprobs/forward_rows"] == 4.0
    # mismatch: (1 + 2) / (16 + 1): the recomputed pi_old's, then the first update's loss
    assert got["mismatch/token_mult_prob_error"] == 3.0 / 17.0
    assert got["loss/pg_loss"] == 0.125 * 10 and got["loss/replay_weight_max"] == 2.0
    assert got["grad_norm"] == 2.5 and got["optim/skipped_updates"] == 1.0 and got["reward/grader_worker_deaths"] == 1


def test_dp2_reports_what_one_rank_with_every_group_reports():
    one = _step_metrics(distributed=False)
    two = run_on_ranks(_step_metrics, 2, args=(True,))
    assert two[0] == two[1]
    assert two[0].pop("reward/grader_worker_deaths") == 1 + 2  # each rank's own count, summed
    one.pop("reward/grader_worker_deaths")
    assert two[0] == one
