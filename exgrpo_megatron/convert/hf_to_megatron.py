"""HF safetensors directory (any family of config/families.py) -> megatron torch_dist checkpoint in the run layout.

Output: `<out>/model/` (dist checkpoint of the "model" key only, TP=1 layout that megatron reshards to any
TP/PP on load), `<out>/model_config.yaml` and, written last, `<out>/manifest.json` (size + sha256 of every file:
the trainer verifies `checkpoint.init_from` against it). Streaming: one megatron tensor (built from at most three
memory-mapped HF tensors) is alive at a time.
"""

from __future__ import annotations

import os

import torch

from exgrpo_megatron.checkpoint.integrity import write_weights_manifest
from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.convert.dist_ckpt_io import ChunkSpec, layer_extra_state_keys, sharded_key, write_dist_checkpoint
from exgrpo_megatron.convert.hf_config import (
    UnsupportedArchitectureError,
    model_config_from_hf,
    read_hf_config,
    save_model_config,
)
from exgrpo_megatron.convert.hf_io import SafetensorsSource
from exgrpo_megatron.convert.hf_mapping import (
    IGNORABLE_HF_SUFFIXES,
    hf_names_for,
    hf_to_megatron,
    megatron_param_names,
    megatron_shape,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_hf_tensors(src: SafetensorsSource, cfg: ModelConfig) -> None:
    """Every HF tensor must be consumed by the mapping (e.g. an o_proj bias would otherwise be dropped)."""
    needed = {n for name in megatron_param_names(cfg) for n in hf_names_for(name, cfg)}
    missing = sorted(needed - set(src.names()))
    if missing:
        raise KeyError(f"{src.hf_dir}: HF tensors missing for the configured architecture: {missing[:10]}")
    extra = [n for n in src.names() if n not in needed and not n.endswith(IGNORABLE_HF_SUFFIXES)
             and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if extra:
        raise UnsupportedArchitectureError(
            f"{src.hf_dir}: HF tensors with no megatron equivalent: {sorted(extra)[:10]}")


def plan_chunks(src: SafetensorsSource, cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> list[ChunkSpec]:
    """One ChunkSpec per megatron parameter (per layer for decoder layers), produced lazily from `src`."""

    def producer(name: str, leading_axes: int):
        def produce() -> torch.Tensor:
            hf = {n: src.get(n) for n in hf_names_for(name, cfg)}
            t = hf_to_megatron(name, hf, cfg, tp_size).to(dtype)
            return t.reshape((1,) * leading_axes + t.shape)
        return produce

    chunks = []
    for name in megatron_param_names(cfg):
        key, index = sharded_key(name)
        shape = megatron_shape(name, cfg, tp_size)
        leading = (cfg.num_layers, cfg.num_experts)[:len(index)]  # a layer's tensor; one expert's of a layer
        chunks.append(ChunkSpec(key, (*leading, *shape), index + (0,) * len(shape), (1,) * len(index) + shape,
                                dtype, producer(name, len(index))))
    return chunks


def convert_hf_to_megatron(hf_dir: str, out_dir: str, tp_size: int = 1, pp_size: int = 1, dtype: str = "auto",
                           progress: bool = True) -> ModelConfig:
    """Convert `hf_dir` into `<out_dir>/model` + `<out_dir>/model_config.yaml`; returns the ModelConfig.
    `tp_size`/`pp_size` only validate that the target layout is possible and set the vocabulary padding."""
    cfg = model_config_from_hf(read_hf_config(hf_dir), hf_path=os.path.abspath(hf_dir))
    if tp_size < 1 or cfg.num_query_groups % tp_size or cfg.num_attention_heads % tp_size:
        valid = [t for t in range(1, cfg.num_query_groups + 1)
                 if cfg.num_query_groups % t == 0 and cfg.num_attention_heads % t == 0]
        raise UnsupportedArchitectureError(
            f"--tp: TP={tp_size} does not divide the model's {cfg.num_query_groups} KV heads (num_key_value_heads) "
            f"and {cfg.num_attention_heads} attention heads (num_attention_heads); use a TP in {valid}")
    if pp_size < 1 or cfg.num_layers % pp_size:
        raise UnsupportedArchitectureError(f"--pp: PP={pp_size} must divide num_hidden_layers={cfg.num_layers}")
    src = SafetensorsSource(hf_dir)
    check_hf_tensors(src, cfg)
    out_dtype = src.dtype() if dtype == "auto" else DTYPES[dtype]
    chunks = plan_chunks(src, cfg, out_dtype, tp_size)
    model_dir = os.path.join(out_dir, "model")
    if os.path.isdir(model_dir) and os.listdir(model_dir):
        raise FileExistsError(f"{model_dir} is not empty")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chunks), desc="hf->megatron", unit="tensor")
    write_dist_checkpoint(model_dir, chunks, layer_extra_state_keys(cfg.num_layers, cfg.num_experts),
                          on_item=(lambda _key: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    save_model_config(cfg, out_dir)
    write_weights_manifest(out_dir)
    return cfg
