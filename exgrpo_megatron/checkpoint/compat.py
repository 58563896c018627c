"""Is a checkpoint's architecture the one we are about to load it into?

`model_config.yaml` holds the `model:` config group the checkpoint was written with. Only fields that
change a parameter's shape (or its existence) make a checkpoint unloadable; everything else (RoPE
theta, dtype, layer spec, recompute, hf_path, ...) may legitimately differ and is not compared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from exgrpo_megatron.config.schema import ModelConfig

SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "vocab_size",
    "tie_word_embeddings",
    "family",  # which tensors exist (q/k/v bias, QK-norm: config/families.py)
)


class IncompatibleCheckpointError(ValueError):
    """The checkpoint's architecture differs from the model it is loaded into."""


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


def _shape_view(fields: dict[str, Any]) -> dict[str, Any]:
    """Shape-relevant fields, with kv_channels resolved the way the model builder resolves it."""
    view = {name: fields.get(name) for name in SHAPE_FIELDS}
    if view["kv_channels"] is None and view["hidden_size"] and view["num_attention_heads"]:
        view["kv_channels"] = int(view["hidden_size"]) // int(view["num_attention_heads"])
    return view


def shape_differences(saved: dict[str, Any], current: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """{field: (checkpoint value, current value)} for every shape field that differs."""
    saved_view = _shape_view(saved)
    current_view = _shape_view(dataclasses.asdict(current))
    return {k: (saved_view[k], current_view[k]) for k in SHAPE_FIELDS if saved_view[k] != current_view[k]}


def check_model_compatible(saved_yaml: str, current: ModelConfig, where: str) -> None:
    differences = shape_differences(parse_model_config_yaml(saved_yaml), current)
    if differences:
        lines = "\n".join(f"  {k}: checkpoint={a!r} current={b!r}" for k, (a, b) in differences.items())
        raise IncompatibleCheckpointError(
            f"checkpoint {where} has an incompatible model architecture ({', '.join(differences)}):\n{lines}"
        )


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
