"""Does a checkpoint compute the function of the model we are about to load it into?

`model_config.yaml` holds the `model:` config group the checkpoint was written with (the converter and every trainer
save write all of its fields). The fields compared are config/model_function.py's: a SHAPE field that differs makes
the checkpoint unloadable; a FUNCTION field that differs (RoPE theta or scaling, the norm's epsilon, the routing's
top-k and renormalisation) loads fine but computes another function, so it is refused too unless the user lists it
in `checkpoint.allow_model_changes`. A field the checkpoint does not record (written before it was recorded) cannot
be checked: refused the same way, naming it, so that nobody trains another function without a word. The rest (dtype,
layer spec, recompute, hf_path, the auxiliary losses' coefficients, ...) may legitimately differ and is not compared.

A resume (the optimizer state too) also needs the expert layout it was saved at: megatron-core keeps the experts'
Adam state in an optimizer of its own at EP > 1 and does not reshard it between EP/ETP sizes (check_expert_layout).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import yaml

from exgrpo_megatron.config.model_function import ALLOW_KEY, MOE_ONLY_FIELDS, SHAPE_FIELDS, compared_view
from exgrpo_megatron.config.schema import ModelConfig

EP_KEY, ETP_KEY = "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size"


class IncompatibleCheckpointError(ValueError):
    """The checkpoint computes another function than the model it is loaded into (or cannot be loaded into it)."""


def model_config_to_yaml(cfg: ModelConfig) -> str:
    """The `model_config.yaml` text for a ModelConfig (a flat mapping of its fields)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def parse_model_config_yaml(text: str) -> dict[str, Any]:
    """Accept a flat mapping of ModelConfig fields, or the same nested under a top-level `model:` key."""
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise IncompatibleCheckpointError(f"model_config.yaml is not a mapping: {type(data).__name__}")
    if set(data) == {"model"} and isinstance(data["model"], dict):
        data = data["model"]
    return data


def same_value(saved: Any, current: Any) -> bool:
    """Equal as the model uses them: floats (RoPE theta, the norm's epsilon) at fp32, the precision a float field is
    written at by a converter reading fp32 files (a GGUF's 9.9999997e-06 is the fp32 value of 1e-05)."""
    numbers = (int, float)
    if isinstance(saved, numbers) and isinstance(current, numbers) and not isinstance(saved, bool) \
            and not isinstance(current, bool):
        return bool(np.float32(saved) == np.float32(current))
    return bool(saved == current)


def model_differences(saved: dict[str, Any], current: ModelConfig) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """({field: (checkpoint value, config value)} of every compared field that differs, [the fields the checkpoint
    does not record although the config's model reads them])."""
    saved = {"num_experts": 0, **saved}  # one written before mixtures of experts existed holds a dense model
    saved_view, current_view = compared_view(saved), compared_view(dataclasses.asdict(current))
    differences = {k: (saved_view[k], v) for k, v in current_view.items()
                   if k in saved_view and not same_value(saved_view[k], v)}
    saved_dense = not saved["num_experts"]  # then num_experts differs: that is the refusal
    unrecorded = [k for k in current_view if k not in saved_view and not (k in MOE_ONLY_FIELDS and saved_dense)]
    return differences, unrecorded


def check_model_compatible(saved_yaml: str, current: ModelConfig, where: str, allowed: Sequence[str] = ()) -> None:
    """IncompatibleCheckpointError naming every `model.<field>` that differs (with both values) or that the checkpoint
    does not record, except the function fields listed in `allowed` (`checkpoint.allow_model_changes`): those are
    announced on stderr (global rank 0) and loaded."""
    differences, unrecorded = model_differences(parse_model_config_yaml(saved_yaml), current)
    refused: dict[str, str] = {}
    announced: list[str] = []
    for k, (a, b) in differences.items():
        line = f"model.{k}: checkpoint {a!r}, config {b!r}"
        if k in allowed and k not in SHAPE_FIELDS:
            announced.append(f"{line} (allowed by {ALLOW_KEY}: the weights compute another function than they did)")
        elif k in SHAPE_FIELDS:
            refused[k] = f"{line} (another shape: the weights cannot be loaded into this model)"
        else:
            refused[k] = (f"{line} (the same weights would compute another function; to load them anyway add "
                          f"{k} to {ALLOW_KEY})")
    for k in unrecorded:
        line = f"model.{k}: the checkpoint does not record it (written before it was recorded), so it cannot be checked"
        if k in allowed:
            announced.append(f"{line}; loaded unchecked ({ALLOW_KEY})")
        else:
            refused[k] = (f"{line}: re-convert it with tools/convert_hf_to_megatron.py, or add {k} to {ALLOW_KEY} to "
                          "load it unchecked")
    if refused:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} does not compute this config's model ({', '.join('model.' + k for k in refused)}):"
            "\n  " + "\n  ".join(refused.values()))
    if announced and _is_rank0():
        for line in announced:
            print(f"exgrpo-train: checkpoint {where}: {line}", file=sys.stderr, flush=True)


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def check_expert_layout(saved_layout: dict[str, int], current_layout: dict[str, int], where: str) -> None:
    """A resume (model and optimizer state) must run at the EP and ETP it was saved at: megatron-core keeps the
    experts' Adam state in an optimizer of its own at EP > 1 and does not reshard it between expert layouts (at
    another EP the load ends in a KeyError). A checkpoint that does not record them (saved before they were
    recorded) is loaded as before."""
    for key, name, field in ((EP_KEY, "EP", "ep"), (ETP_KEY, "ETP", "etp")):
        saved = saved_layout.get(field)
        if saved is None or saved == current_layout[field]:
            continue
        raise IncompatibleCheckpointError(
            f"{key}: checkpoint {where} was saved at {name}={saved}, this run has {name}={current_layout[field]}: the "
            f"experts' optimizer state is not resharded between expert layouts. Resume at {key}={saved}, or start a "
            f"new run from its weights only (checkpoint.init_from={where}, checkpoint.resume=none, another "
            "logging.run_dir: the Adam state starts afresh)")


def check_padded_vocab(checkpoint_vocab: int | None, model_vocab: int | None, where: str) -> None:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * TP, so the same
    model can have a different embedding row count at another TP size; dist_checkpointing cannot
    reshard across that. Say so plainly instead of failing inside torch.distributed.checkpoint."""
    if checkpoint_vocab is None or model_vocab is None or checkpoint_vocab == model_vocab:
        return
    raise IncompatibleCheckpointError(
        f"checkpoint {where} stores a padded vocabulary of {checkpoint_vocab} rows but the model has {model_vocab}: "
        "the padding is make_vocab_size_divisible_by * TP; choose make_vocab_size_divisible_by so that both "
        "layouts pad to the same size (e.g. a multiple of the largest TP size you use)"
    )
