"""Layout-invariant initialisation: the same weights at every TP/PP layout.

Megatron draws each pipeline stage's initial weights from that stage's own RNG stream, so a PP=2
model starts from other weights than a PP=1 model with the same seed. For runs that start from
scratch (tests, the demo) every parameter is instead drawn from a generator seeded by
(seed, its layout-independent global name, model/param_layout.py: an expert's name carries its global expert
index, so EP ranks draw the experts of EP=1) as a full tensor and this rank's TP (experts: ETP) slice is kept:
weights ~ N(0, std), output projections (linear_proj, linear_fc2) ~ N(0, std / sqrt(2 L))
(megatron's scaled init), norms = 1, biases = 0; LoRA adapters (model/lora.py): A as `lora.init` says, B = 0.
"""

from __future__ import annotations

import hashlib
import math

import torch

from exgrpo_megatron.config.schema import LoraConfig, ModelConfig
from exgrpo_megatron.model.param_layout import (
    is_adapter,
    named_global_params,
    tp_coords,
    tp_full_shape,
    tp_shard,
    tp_split_of_param,
)


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % (2**63)


def initialise(modules: list[torch.nn.Module], cfg: ModelConfig, seed: int, lora: LoraConfig | None = None) -> None:
    """Draw every parameter of this rank's model chunks `modules` from (seed, its global name); `lora`: the
    adapters' settings when the chunks have adapters."""
    for name, p in named_global_params(modules, tied_copy=True):  # the tied output layer gets the embedding
        tp, tp_rank = tp_coords(name)
        split = tp_split_of_param(p)
        shape = tp_full_shape(p.shape, split, tp)
        if lora is not None and is_adapter(name):
            from exgrpo_megatron.model.lora import init_adapter

            full = init_adapter(name, shape, lora, torch.Generator().manual_seed(_seed(seed, name)))
        elif "norm" in name or name.endswith("layer_norm_weight"):
            full = torch.ones(shape)
        elif name.endswith("bias"):
            full = torch.zeros(shape)
        else:
            std = cfg.init_method_std
            if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                std /= math.sqrt(2.0 * cfg.num_layers)
            g = torch.Generator().manual_seed(_seed(seed, name))
            full = torch.randn(shape, generator=g) * std
        with torch.no_grad():
            p.data.copy_(tp_shard(full, split, tp, tp_rank).to(device=p.device, dtype=p.dtype))
