"""The `model.*` fields that decide what function a checkpoint's weights compute, and which of them a user may change
on purpose (`checkpoint.allow_model_changes`).

A checkpoint records its `model:` group (`model_config.yaml`, written by the converter and by every trainer save).
Loading it (`checkpoint.init_from`, resume) compares each field below with the config (checkpoint/compat.py):

* SHAPE fields change which tensors exist or their shapes; such weights cannot be loaded at all. `family` is one:
  it fixes the q/k/v bias and QK-norm (config/families.py).
* FUNCTION fields leave every shape alone but change what the same weights compute (RoPE, the norm's epsilon, the
  routing). A difference is refused unless the field is listed in `checkpoint.allow_model_changes`.

The MoE fields are compared only for mixture-of-experts models (num_experts > 0 on either side): a dense model never
reads them.
"""

from __future__ import annotations

from typing import Any

SHAPE_FIELDS: tuple[str, ...] = (
    "family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "vocab_size", "tie_word_embeddings", "num_experts", "moe_ffn_hidden_size",
)
FUNCTION_FIELDS: tuple[str, ...] = (
    "rope_theta", "rope_scaling_factor", "rms_norm_eps", "moe_router_topk", "norm_topk_prob",
)
MOE_ONLY_FIELDS = frozenset({"moe_ffn_hidden_size", "moe_router_topk", "norm_topk_prob"})
COMPARED_FIELDS: tuple[str, ...] = SHAPE_FIELDS + FUNCTION_FIELDS
ALLOW_KEY = "checkpoint.allow_model_changes"


def allow_model_changes_errors(names: list[str]) -> list[str]:
    """`checkpoint.allow_model_changes` names FUNCTION fields only (a shape cannot be loaded into another)."""
    def why(name: str) -> str:
        return "a shape field cannot be loaded into another shape" if name in SHAPE_FIELDS else "a field name"

    return [f"{ALLOW_KEY}: {name!r} is not a model field a checkpoint may differ in ({why(name)}; those are "
            f"{list(FUNCTION_FIELDS)})" for name in names if name not in FUNCTION_FIELDS]


def compared_view(fields: dict[str, Any]) -> dict[str, Any]:
    """The compared fields of a flat `model:` mapping as the model builder resolves them (head dim, the experts'
    FFN size); a field the mapping does not record is absent. Dense models: no MoE field, the dense FFN size;
    MoE models (every layer a mixture of experts): the experts' FFN size, no dense one."""
    view = {name: fields[name] for name in COMPARED_FIELDS if name in fields}
    if view.get("kv_channels") is None and fields.get("hidden_size") and fields.get("num_attention_heads"):
        view["kv_channels"] = int(fields["hidden_size"]) // int(fields["num_attention_heads"])
    moe = int(fields.get("num_experts") or 0) > 0
    if not moe:
        for name in MOE_ONLY_FIELDS:
            view.pop(name, None)
    else:
        if "moe_ffn_hidden_size" in fields:
            view["moe_ffn_hidden_size"] = fields["moe_ffn_hidden_size"] or fields.get("ffn_hidden_size")
        view.pop("ffn_hidden_size", None)
    return view
