"""LoRA adapters <-> a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`), the format
`peft.PeftModel.from_pretrained(hf_base, dir)` loads onto the HF model of the same family.

PEFT adapts the HF model's separate projections, we adapt megatron's fused linears (model/lora.py):

- linear_qkv (rows group-interleaved q/k/v) <-> q_proj, k_proj, v_proj; linear_fc1 ([gate; up]) <-> gate_proj,
  up_proj; linear_proj <-> o_proj; linear_fc2 <-> down_proj. B is split (export) or joined (import) exactly as the
  base weight's rows are (convert/hf_mapping.py, the one table of both), A is the fused linear's one A, copied to
  every projection on export.
- Import of projections whose A differ (PEFT trains one A per projection): exact when `lora.rank` is at least
  (projections of the fused linear) x PEFT's r with the same alpha / rank: the projections' adapters take
  disjoint rank slots of the fused adapter (A stacked, B block-diagonal), the unused slots zero. With
  `lora.rank` = r the A must be equal (as an export of ours has them).
- The scale alpha / r is the same on both sides (PEFT's default, not rsLoRA); adapters on MoE experts have no PEFT
  equivalent here (transformers holds a layer's experts as one 3-D parameter): refused, naming `lora.experts`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from exgrpo_megatron.config.schema import LoraConfig, ModelConfig, RootConfig
from exgrpo_megatron.convert.hf_mapping import hf_names_for, hf_to_megatron, megatron_param_names, megatron_shape
from exgrpo_megatron.convert.hf_mapping import megatron_to_hf as split_to_hf
from exgrpo_megatron.model.param_layout import is_expert_param

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model
# our target -> the megatron linear (in a decoder layer) and PEFT's projection names
TARGET_LINEAR = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                 "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
TARGET_PROJECTIONS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                      "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
# PEFT options that change the adapted function or add weights we have no place for
_UNSUPPORTED_OPTIONS: dict[str, Any] = {
    "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
    "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none"}


class PeftAdapterError(ValueError):
    """An adapter that does not fit (the message starts with the config key to change)."""


def adapted_weights(cfg: ModelConfig, targets: list[str]) -> list[str]:
    """The megatron weights (global names) whose linears carry adapters for `targets`: attention's and the dense
    MLP's; never the experts' (no PEFT equivalent)."""
    suffixes = tuple(f".{TARGET_LINEAR[t]}.weight" for t in targets)
    return [n for n in megatron_param_names(cfg) if n.endswith(suffixes) and not is_expert_param(n)]


def _modules(weight: str, cfg: ModelConfig) -> list[str]:
    """PEFT's module names (PeftModel's) of the HF projections of megatron linear `weight`."""
    return [PEFT_PREFIX + n.removesuffix(".weight") for n in hf_names_for(weight, cfg)]


# ---------------------------------------------------------------- export
def peft_adapter_tensors(weight: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig
                         ) -> list[tuple[str, torch.Tensor]]:
    """PEFT's (key, tensor) pairs of the fused linear `weight`'s adapter A [r, in], B [out, r] (full, TP=1)."""
    out = []
    for hf_name, b_part in split_to_hf(weight, b, cfg):
        module = PEFT_PREFIX + hf_name.removesuffix(".weight")
        out += [(f"{module}.lora_A.weight", a.clone().contiguous()), (f"{module}.lora_B.weight", b_part.contiguous())]
    return out


def peft_adapter_config(lora: LoraConfig, targets: list[str], base_model: str | None) -> dict[str, Any]:
    modules = [m for t in targets for m in TARGET_PROJECTIONS[t]]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
            "init_lora_weights": True, "inference_mode": True, **_UNSUPPORTED_OPTIONS}


def write_peft_adapter(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


# ---------------------------------------------------------------- import
def read_peft_config(adapter_dir: str) -> dict[str, Any]:
    for needed in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(adapter_dir, needed)):
            raise PeftAdapterError(f"lora.init_from: {adapter_dir!r}: has no {needed} (not a PEFT adapter directory)")
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
        return json.load(f)


def _peft_targets(peft: dict[str, Any], where: str) -> set[str]:
    """Our targets equivalent to PEFT's target_modules (every projection of a fused linear, or none of them)."""
    modules = peft.get("target_modules")
    if not isinstance(modules, list):
        raise PeftAdapterError(f"lora.init_from: {where}: target_modules {modules!r}: expected a list of module names")
    names = {m.rsplit(".", 1)[-1] for m in modules}
    known = {p for ps in TARGET_PROJECTIONS.values() for p in ps}
    if names - known:
        raise PeftAdapterError(f"lora.init_from: {where}: target_modules {sorted(names - known)} have no megatron "
                               f"linear here (supported: {sorted(known)})")
    out = set()
    for target, projections in TARGET_PROJECTIONS.items():
        present = names & set(projections)
        if present and present != set(projections):
            raise PeftAdapterError(f"lora.targets: {where} adapts {sorted(present)} but not "
                                   f"{sorted(set(projections) - present)}: megatron's {target} fuses them")
        if present:
            out.add(target)
    return out


def peft_adapter_errors(cfg: RootConfig) -> list[str]:
    """Start-up check of `lora.init_from` against the config (options, targets, rank and scale, every tensor's
    shape), reading only the adapter's config and the safetensors header; `key: reason` lines."""
    where = cfg.lora.init_from
    if not where:
        return []
    try:
        _check_adapter(where, cfg.model, cfg.lora, _stored_shapes(where))
    except PeftAdapterError as exc:
        return [str(exc)]
    return []


def _stored_shapes(adapter_dir: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    read_peft_config(adapter_dir)
    with safe_open(os.path.join(adapter_dir, ADAPTER_WEIGHTS), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _check_adapter(where: str, cfg: ModelConfig, lora: LoraConfig, shapes: dict[str, tuple[int, ...]]) -> int:
    """Refusals (PeftAdapterError naming the key); returns PEFT's r."""
    peft = read_peft_config(where)
    if peft.get("peft_type") != "LORA":
        raise PeftAdapterError(f"lora.init_from: {where}: peft_type {peft.get('peft_type')!r}, expected 'LORA'")
    for option, plain in _UNSUPPORTED_OPTIONS.items():
        if peft.get(option, plain) not in (plain, None, [], {}):
            raise PeftAdapterError(f"lora.init_from: {where}: {option}={peft[option]!r} is not supported (the "
                                   f"adapter would not be y = W x + B A x * alpha / r on the base linears)")
    if cfg.num_experts and lora.experts:
        raise PeftAdapterError("lora.experts: true has no PEFT adapter format (transformers holds a layer's experts "
                               "as one 3-D parameter); set it false (attention only)")
    r, alpha = int(peft["r"]), float(peft["lora_alpha"])
    targets = _peft_targets(peft, where)
    ours = {t for t in lora.targets if adapted_weights(cfg, [t])}
    if targets != ours:
        raise PeftAdapterError(f"lora.targets: {sorted(ours)} adapt this model, the adapter at {where} adapts "
                               f"{sorted(targets)}")
    fused = max((len(TARGET_PROJECTIONS[t]) for t in targets), default=1)
    if not math.isclose(lora.alpha / lora.rank, alpha / r, rel_tol=1e-9):
        raise PeftAdapterError(f"lora.alpha: {lora.alpha} / lora.rank {lora.rank} != the adapter's lora_alpha "
                               f"{alpha} / r {r}: the adapter's scale must be kept")
    if lora.rank != r and lora.rank < fused * r:
        raise PeftAdapterError(f"lora.rank: {lora.rank}: the adapter at {where} has r={r}; use lora.rank={r}, or "
                               f"{fused * r} (lora.alpha {alpha * fused}) for projections with separate A")
    for weight in adapted_weights(cfg, sorted(targets)):
        full = torch.empty(megatron_shape(weight, cfg), device="meta")
        for (hf_name, base), module in zip(split_to_hf(weight, full, cfg), _modules(weight, cfg), strict=True):
            for factor, want in (("lora_A", (r, base.shape[1])), ("lora_B", (base.shape[0], r))):
                key = f"{module}.{factor}.weight"
                if shapes.get(key) != want:
                    raise PeftAdapterError(f"lora.init_from: {where}: {key} is {shapes.get(key)}, this model's "
                                           f"{hf_name} needs {want} (another base model, model.* differs)")
    return r


def megatron_adapters_from_peft(adapter_dir: str, cfg: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The full (TP=1) `<linear>.lora_a` / `lora_b` tensors (global names) of a PEFT adapter directory, checked
    first (PeftAdapterError naming the key). Projections of a fused linear with equal A share it; otherwise they
    take disjoint rank slots (A stacked, B block-diagonal): the same function at lora.rank >= projections x r."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    r = _check_adapter(adapter_dir, cfg, lora, {k: tuple(v.shape) for k, v in tensors.items()})
    rank = lora.rank
    out: dict[str, torch.Tensor] = {}
    for weight in adapted_weights(cfg, list(lora.targets)):
        modules = _modules(weight, cfg)
        hf_names = hf_names_for(weight, cfg)
        a_parts = [tensors[f"{m}.lora_A.weight"].float() for m in modules]
        b_parts = [tensors[f"{m}.lora_B.weight"].float() for m in modules]
        shared = rank == r and all(torch.equal(a, a_parts[0]) for a in a_parts)
        if rank == r and not shared:
            raise PeftAdapterError(f"lora.rank: {rank}: {modules} have different lora_A, which megatron's fused "
                                   f"linear shares at this rank; use lora.rank={len(modules) * r} (and alpha to keep "
                                   "alpha / rank) to load them exactly")
        if shared:
            a, bs = a_parts[0], b_parts
        else:
            a = torch.zeros(rank, a_parts[0].shape[1])
            bs = []
            for k, (a_k, b_k) in enumerate(zip(a_parts, b_parts, strict=True)):
                a[k * r:(k + 1) * r] = a_k
                padded = torch.zeros(b_k.shape[0], rank)
                padded[:, k * r:(k + 1) * r] = b_k
                bs.append(padded)
        stem = weight.removesuffix("weight")
        out[stem + "lora_a"] = a
        out[stem + "lora_b"] = hf_to_megatron(weight, dict(zip(hf_names, bs, strict=True)), cfg)
    return out
