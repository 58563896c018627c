"""LoRA adapters on megatron-core's tensor-parallel linears (the local layer spec).

An adapted linear computes  y = W x + (B A dropout(x)) * alpha / r  with A: [r, in], B: [out, r], and returns
megatron's (output, bias) tuple. The adapters are parameters of the linear itself (`<linear>.lora_a`,
`<linear>.lora_b`), so the base weight keeps its name (`<linear>.weight`) for the converters, the refit and the
checkpoints. Sharding follows the base linear so that every TP layout computes the same function as one rank:

- column-parallel (linear_qkv, linear_fc1; W sharded over its output rows): A is replicated, B is sharded over
  TP like W's rows (linear_fc1's SwiGLU stride 2 included: rank r holds [B_gate_r; B_up_r]). The rank-r hidden
  h = A x passes `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of dL/dh backward), so A's
  gradient, which needs every rank's B slice, is the full one on every rank.
- row-parallel (linear_proj, linear_fc2; W sharded over its input columns, input already split): A is sharded
  over TP like W's columns, B is replicated; the partial h = A_r x_r is summed over TP
  (`reduce_from_tensor_model_parallel_region`) as the base's partial output is.

MoE experts (`lora.experts`) use the expert TP group, which config/validate.py requires to be of size 1.
Initialisation is model/layout_init.py's (seeded by global name): A kaiming-uniform or gaussian, B zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from exgrpo_megatron.config.schema import LoraConfig
from exgrpo_megatron.model.param_layout import is_adapter


def lora_scale(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


def init_adapter(name: str, shape: tuple[int, ...], cfg: LoraConfig, generator: torch.Generator) -> torch.Tensor:
    """The full (TP=1) initial value of adapter `name`: B = 0 (step 0 is the base model); A [r, in] kaiming-uniform
    with a = sqrt(5) (bound 1/sqrt(in), PEFT's default) or N(0, 1/r) (PEFT's gaussian)."""
    if name.endswith("lora_b"):
        return torch.zeros(shape)
    if cfg.init == "gaussian":
        return torch.randn(shape, generator=generator) / cfg.rank
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=generator) * (2 * bound) - bound


class _LoraMixin:
    """Adds `lora_a`, `lora_b`, the dropout and the scale to a megatron linear built by its own __init__."""

    weight: torch.nn.Parameter
    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter

    def _add_adapters(self, lora: LoraConfig, a_shape: tuple[int, int], b_shape: tuple[int, int],
                      dtype: torch.dtype) -> None:
        module: Any = self
        device = self.weight.device
        module.lora_a = torch.nn.Parameter(torch.empty(a_shape, dtype=dtype, device=device))
        module.lora_b = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
        module.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        module.lora_scale = lora_scale(lora)
        for p in (module.lora_a, module.lora_b):  # experts: reduced over the expert-DP group, as the weight is
            p.allreduce = getattr(self.weight, "allreduce", True)

    def _adapter_delta_input(self, x: torch.Tensor) -> torch.Tensor:
        module: Any = self
        return F.linear(module.lora_dropout(x), module.lora_a)


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """ColumnParallelLinear + adapter: A [r, in] replicated, B [out / TP, r] sharded as the weight's rows."""

    def __init__(self, *args: Any, lora: LoraConfig, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.gather_output:
            raise ValueError("LoRA on a column-parallel linear that gathers its output is not supported")
        self._add_adapters(lora, (lora.rank, self.input_size), (self.output_size_per_partition, lora.rank),
                           self.config.params_dtype)
        set_tensor_model_parallel_attributes(self.lora_b, True, 0, getattr(self.weight, "partition_stride", 1))

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        h = copy_to_tensor_model_parallel_region(self._adapter_delta_input(input_), group=self.tp_group)
        return output + F.linear(h, self.lora_b) * self.lora_scale, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        sd = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                 {"weight": 0, "bias": 0, "lora_b": 0}, sharded_offsets,
                                                 tp_group=self.tp_group, dp_cp_group=(metadata or {})["dp_cp_group"])
        if getattr(self.lora_b, "partition_stride", 1) == 2:  # SwiGLU fc1: [B_gate_r; B_up_r], as the weight
            key = f"{prefix}lora_b"
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                   (metadata or {}).get("singleton_local_shards", False))
        return sd


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """RowParallelLinear + adapter: A [r, in / TP] sharded as the weight's columns, B [out, r] replicated."""

    def __init__(self, *args: Any, lora: LoraConfig, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("LoRA on a row-parallel linear whose input is not split over TP is not supported")
        self._add_adapters(lora, (lora.rank, self.input_size_per_partition), (self.output_size, lora.rank),
                           self.config.params_dtype)
        set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = super().forward(input_)
        h = reduce_from_tensor_model_parallel_region(self._adapter_delta_input(input_), group=self.tp_group)
        return output + F.linear(h, self.lora_b) * self.lora_scale, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict:
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"weight": 1, "lora_a": 1}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {})["dp_cp_group"])


def add_lora_to_spec(layer_spec: Any, lora: LoraConfig) -> None:
    """Replace the targeted linears of a local-spec transformer layer's ModuleSpec (in place) with their LoRA
    versions: attention's linear_qkv / linear_proj, the dense MLP's (or, with `lora.experts`, every expert's)
    linear_fc1 / linear_fc2."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    kinds = {"linear_qkv": LoraColumnParallelLinear, "linear_fc1": LoraColumnParallelLinear,
             "linear_proj": LoraRowParallelLinear, "linear_fc2": LoraRowParallelLinear}

    def adapt(submodules: Any, names: tuple[str, ...]) -> None:
        for name in names:
            if name not in lora.targets:
                continue
            base = getattr(submodules, name)
            base_cls = base.module if isinstance(base, ModuleSpec) else base
            if base_cls not in (ColumnParallelLinear, RowParallelLinear):
                raise ValueError(f"LoRA: {name} is {base_cls!r}, not megatron's local parallel linear")
            setattr(submodules, name, ModuleSpec(module=kinds[name], params={"lora": lora}))

    layer = layer_spec.submodules
    adapt(layer.self_attention.submodules, ("linear_qkv", "linear_proj"))
    mlp = layer.mlp
    experts = getattr(mlp.submodules, "experts", None)
    if experts is None:  # dense MLP
        adapt(mlp.submodules, ("linear_fc1", "linear_fc2"))
    elif lora.experts:
        adapt(experts.submodules, ("linear_fc1", "linear_fc2"))


def load_adapters(modules: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Set every adapter of this rank's chunks from `full` (global name -> the TP=1 tensor; `lora.init_from`),
    keeping this rank's TP part; `full` must name exactly the model's adapters."""
    from exgrpo_megatron.model.param_layout import named_global_params, tp_coords, tp_shard, tp_split_of_param

    adapters = [(n, p) for n, p in named_global_params(modules, tied_copy=False) if is_adapter(n)]
    missing = sorted({n for n, _ in adapters} - set(full))
    if missing:
        raise ValueError(f"no values for the adapters {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name, p in adapters:
        tp, tp_rank = tp_coords(name)
        with torch.no_grad():
            p.copy_(tp_shard(full[name], tp_split_of_param(p), tp, tp_rank).to(device=p.device, dtype=p.dtype))


def freeze_base(modules: list[torch.nn.Module]) -> None:
    """Only the adapters train: every other parameter gets requires_grad False (megatron's DDP then gives it no
    gradient buffer and its optimizer no state)."""
    for module in modules:
        for name, p in module.named_parameters():
            p.requires_grad_(is_adapter(name))
