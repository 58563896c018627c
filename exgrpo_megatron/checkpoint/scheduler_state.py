"""The LR / weight-decay scheduler on resume: progress from the checkpoint, schedule from the config.

megatron's `OptimizerParamScheduler.load_state_dict` (default `use_checkpoint_opt_param_scheduler=True`)
takes every field from the checkpoint: max/min LR, warmup, decay horizon, decay style, weight decay.
Our decay horizon is `trainer.total_steps x updates per step`, so a run resumed with a longer
`trainer.total_steps` kept decaying over the old horizon (a cosine schedule then sits at `min_lr` past
it), and a changed `optim.lr` was ignored -- silently. Here only the progress `num_steps` (updates taken)
comes from the checkpoint; the schedule is the current config's, evaluated at that progress:

    lr, wd = schedule_config(num_steps_checkpoint)

With an unchanged config this is exactly megatron's restore; fields that differ are returned so the
caller can say so.
"""

from __future__ import annotations

from typing import Any

SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
                   "wd_incr_steps", "wd_incr_style")


def schedule_differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (checkpoint value, config value)} for the schedule fields that differ."""
    shared = [k for k in SCHEDULE_FIELDS if k in saved and k in current]
    return {k: (saved[k], current[k]) for k in shared if saved[k] != current[k]}


def restore_scheduler(scheduler, saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set `scheduler` (built from the current config) to the checkpoint's progress; sets the optimizer's
    LR / weight decay for that progress. Returns schedule_differences(saved, current)."""
    differences = schedule_differences(saved, scheduler.state_dict())
    steps = saved.get("num_steps", saved.get("num_iters"))
    if steps is None:
        raise ValueError(f"scheduler state has no num_steps: {sorted(saved)}")
    scheduler.num_steps = 0
    scheduler.step(increment=int(steps))
    return differences


# The optimizer hyperparameters megatron keeps per param group and the config sets: loading the optimizer's
# state restores the checkpoint's values, and megatron's scheduler prefers a group's max_lr / min_lr over its
# own. Taken from the config-built optimizer before the load and put back after it, so a changed optim.lr,
# optim.min_lr, optim.adam_beta1/2 or optim.adam_eps applies (unchanged config: the same values, no-op).
CONFIG_GROUP_KEYS = ("max_lr", "min_lr", "betas", "eps")


def config_group_values(optimizer) -> list[dict[str, Any]]:
    """The CONFIG_GROUP_KEYS of each param group of a freshly built (config) optimizer."""
    return [{k: group[k] for k in CONFIG_GROUP_KEYS if k in group} for group in optimizer.param_groups]


def reapply_config_group_values(optimizer, values: list[dict[str, Any]]) -> None:
    """Put config_group_values back into the param groups after optimizer.load_state_dict."""
    for group, saved in zip(optimizer.param_groups, values, strict=True):
        group.update(saved)
