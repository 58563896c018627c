"""Resume with a changed config: the checkpoint's `config.yaml` against the current config, key by key.

Most keys may change on resume and take effect for real, each announced in one line (`exgrpo-train: resume:
optim.lr: 0.0001 -> 5e-05 (applied)`): the optimizer's LR schedule and Adam settings come from the current
config (checkpoint/scheduler_state.py), everything else is read from the config every step. The keys in
schema.RESUME_REFUSED change what the saved state means; a resume that changes one stops at start-up (exit 2)
naming each key, unless `checkpoint.allow_config_change` lists it. The model's fields that decide what its weights
compute (config/model_function.py) are checked when the checkpoint loads (checkpoint/compat.py), before this: a shape
field is refused always, a function field unless `checkpoint.allow_model_changes` lists it (then announced here too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from exgrpo_megatron.config.aliases import RENAMED_KEYS
from exgrpo_megatron.config.model_function import FUNCTION_FIELDS
from exgrpo_megatron.config.schema import RESUME_REFUSED as REFUSED
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.config.validate import ConfigError

BATCH_KEYS = ("trainer.train_batch_size", "trainer.ppo_mini_batch_size")

# how each allowed group takes effect (the line says so); keys not listed: read from the config every step
APPLIED_HOW: dict[str, str] = {
    "optim.": "applied: the optimizer and LR schedule follow this config at the saved progress",
    "trainer.total_steps": "applied: the LR decay horizon follows it",
}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf} of nested mappings (lists are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in out.items()}


def config_differences(saved_yaml: str, cfg: RootConfig) -> dict[str, tuple[Any, Any]]:
    """{key: (checkpoint value, current value)} of every leaf that differs (a key on one side only included). A
    checkpoint written before a key was renamed has it under the old name (config/aliases.py): compared as the new;
    one written before a key existed ran at the key's default: compared as that. A checkpoint written before a
    variant's settings moved into `algo.settings` recorded every one of them under its flat name, set or not: such a
    key that this config does not set is not compared (the variant's declared default applies, algo/settings.py)."""
    saved = flatten(dataclasses.asdict(RootConfig()))
    saved_tree = flatten(yaml.safe_load(saved_yaml) or {})
    current = flatten(dataclasses.asdict(cfg))
    saved.update({RENAMED_KEYS.get(k, k): v for k, v in saved_tree.items()
                  if not RENAMED_KEYS.get(k, k).startswith("algo.settings.") or RENAMED_KEYS[k] in current})
    missing = object()
    out = {}
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, missing), current.get(key, missing)
        if a != b:
            out[key] = (None if a is missing else a, None if b is missing else b)
    return out


def batch_change(changes: dict[str, tuple[Any, Any]], cfg: RootConfig) -> str:
    """What a change of trainer.train_batch_size / ppo_mini_batch_size really changes, from both sides' values."""
    t = cfg.trainer
    now = {"trainer.train_batch_size": t.train_batch_size, "trainer.ppo_mini_batch_size": t.ppo_mini_batch_size}
    old = {k: int(changes[k][0]) if k in changes and changes[k][0] is not None else v for k, v in now.items()}
    (b0, m0), (b1, m1) = old.values(), now.values()
    u0, u1 = max(1, b0 // max(1, m0)), max(1, b1 // max(1, m1))  # config/derived.updates_per_step
    batch = f"the batch from {b0} prompts per step in updates of {m0} to {b1} in updates of {m1}"
    if u0 != u1:
        return (f"{batch}, so from {u0} to {u1} optimizer updates per step: the LR schedule's progress (counted in "
                "updates) would no longer match the step count")
    return (f"{batch} (still {u1} optimizer updates per step, so the LR schedule keeps pace): each update averages "
            f"{m1} prompts instead of {m0} (the saved Adam moments were estimated over {m0}) and the sampler draws "
            f"{b1} prompts per step instead of {b0}")


def how_applied(key: str) -> str:
    if key.startswith("model.") and key.split(".", 1)[1] in FUNCTION_FIELDS:
        return "allowed by checkpoint.allow_model_changes: the saved weights compute another function"
    return next((how for prefix, how in APPLIED_HOW.items() if key.startswith(prefix)), "applied")


def check_resume_config(saved_yaml: str | None, cfg: RootConfig, where: str) -> list[str]:
    """The lines announcing each change (one per key), or ConfigError naming every refused key."""
    if saved_yaml is None:
        return [f"checkpoint {where} has no config.yaml: changes of the config cannot be checked"]
    allowed = set(cfg.checkpoint.allow_config_change)
    changes = {k: v for k, v in config_differences(saved_yaml, cfg).items()
               if k not in ("checkpoint.allow_config_change", "checkpoint.allow_model_changes")}
    refused = [f"{k}: checkpoint {a!r} -> config {b!r}: changes "
               f"{batch_change(changes, cfg) if k in BATCH_KEYS else REFUSED[k]}; to resume anyway add it to "
               f"checkpoint.allow_config_change" for k, (a, b) in changes.items() if k in REFUSED and k not in allowed]
    if refused:
        raise ConfigError([f"resuming from {where}: the config changes keys that a resume cannot take over:",
                           *refused])
    return [f"{k}: {a!r} -> {b!r} ("
            f"{'allowed by checkpoint.allow_config_change' if k in REFUSED else how_applied(k)})"
            for k, (a, b) in changes.items()]
