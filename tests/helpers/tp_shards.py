"""The reference shards of a full megatron tensor per TP rank, from the package's layout rules (which rows or columns
a layer splits, the builder's vocabulary padding): what the converter's and the loader's tests compare against."""

from __future__ import annotations

import torch

from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.model.param_layout import VOCAB_PARALLEL, canonical_name, pad_vocab, tp_shard, tp_split_of_name


def split_for_tp(name: str, full_tensor: torch.Tensor, tp_size: int, cfg: ModelConfig) -> list[torch.Tensor]:
    """Per-TP-rank shards (index = TP rank) of FULL megatron tensor `name`, as megatron's TP layers hold
    them; the vocabulary is first re-padded to the builder's padded size."""
    name = canonical_name(name)
    if name in VOCAB_PARALLEL:
        full_tensor = pad_vocab(full_tensor, cfg, tp_size)
    elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        if cfg.num_query_groups % tp_size:  # a rank must hold whole query groups
            raise ValueError(f"TP={tp_size} does not divide the {cfg.num_query_groups} KV heads (query groups)")
    split = tp_split_of_name(name)
    return [tp_shard(full_tensor, split, tp_size, r) for r in range(tp_size)]
