"""A decode step with static shapes and no host synchronisation, over preallocated per-slot device buffers.

`DecodeSlots` holds, for `slots` rows (sequences being generated), every tensor a decode step reads or writes:
a [slots, groups, max_len, d] key and value cache per layer (zeros at allocation, RoPE applied once), `valid`
[slots, max_len] (keys a row may attend), `position` (where the row's next fed token goes), `seed` (the row's
counter-based seed, rollout/sampling.py), `count` (tokens drawn), `finished`, `token` (the last drawn token), and
the drawn tokens / log-probs [slots, max_new_tokens + 1] (the last column is where a finished row's draws go).

`DecodeStep.run(slots, bucket)` advances rows 0..bucket-1 by one token: feed `token` at `position`, attend over the
whole cache row under `valid` (static shape: no slicing by the longest row), sample on the device, record the draw
and the device-side stops (EOS, stop token ids, max_new_tokens). Finished rows keep being computed (their draws go
to the spare column and their state does not move) until the host looks, every `stop_check_every` steps
(rollout/continuous.py). Nothing in it reads a tensor on the host or makes a shape depend on data, so it can be
`torch.compile(fullgraph=True)`-d (CPU, `compile_decode`) or captured once per bucket as a CUDA graph and replayed
(`cuda_graphs`, rollout/cuda_graph_step.py).

Randomness equals the chunked engine's: the uniform of row r at draw t is sampling.uniform(seed_r, t), computed
here on int64 tensors with the same SplitMix64 (two's-complement wrap-around = arithmetic mod 2**64, logical right
shifts masked), so the same 53 bits. Buckets: the batch is padded to the smallest of `decode_buckets(slots)`;
each (bucket, sampling constants) pair gets its own copy of the step function, so each compiles once and no
compiled graph is ever re-specialised (tests/test_static_decode.py runs it under `error_on_recompile`).
"""

from __future__ import annotations

import math
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exgrpo_megatron.rollout.kv_decode import cache_attention, layer_forward, signed_sin, unsupported_reason
from exgrpo_megatron.rollout.sampling import mask_padded_vocab, sample_tokens

_MASK64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """The int64 with the bit pattern of the unsigned 64-bit `value`."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """sampling.splitmix64 element-wise on int64 tensors holding unsigned 64-bit patterns."""
    z = x + as_int64(0x9E3779B97F4A7C15)
    z = (z ^ _shift_right(z, 30)) * as_int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * as_int64(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)


def uniform_tensor(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """sampling.uniform(seed, step) element-wise, float64: the same value bit for bit."""
    return _shift_right(splitmix64_tensor(seeds ^ splitmix64_tensor(steps)), 11).double() * (1.0 / (1 << 53))


def decode_buckets(slots: int) -> list[int]:
    """Batch sizes a step runs at: powers of two below `slots`, then `slots`."""
    sizes = [1 << i for i in range(max(slots - 1, 0).bit_length()) if 1 << i < slots]
    return [*sizes, slots]


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket holding `rows` rows (rows 0..rows-1)."""
    return next(b for b in buckets if b >= rows)


def static_unsupported_reason(model) -> str | None:
    """None when the static step runs `model`; else why not (the engine then decodes in length-sorted chunks)."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.model.routing_replay import router_choices

    if (why := unsupported_reason(model)) is not None:
        return why
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return "pipeline parallelism"
    if ps.get_tensor_model_parallel_world_size() > 1:
        return "tensor parallelism"
    if getattr(model.config, "num_moe_experts", None) or router_choices(model):
        return "mixture-of-experts layers (token dispatch has data-dependent shapes; routes are recorded on the host)"
    return None


HOST_READ_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "nonzero", "unique"})
HOST_READ_FUNCTIONS = frozenset({torch.nonzero, torch.unique, torch.masked_select, torch.Tensor.item})


class HostReadInStep(RuntimeError):
    """The decode step reads a tensor on the host or has a data-dependent shape."""


def inductor_without_host_reads(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A torch.compile backend: inductor, after refusing a graph that reads a tensor on the host (`.item()`,
    `.tolist()`, `.cpu()`) or makes a shape depend on data (nonzero, unique, masked_select); torch traces `.item()`
    into the graph without a break, so fullgraph alone would let a per-step host synchronisation through."""
    from torch._inductor.compile_fx import compile_fx

    for node in graph.graph.nodes:
        if (node.op == "call_method" and node.target in HOST_READ_METHODS) or \
                (node.op == "call_function" and node.target in HOST_READ_FUNCTIONS):
            raise HostReadInStep(f"the decode step calls {node.target} ({node.format_node()}): a host read")
    return compile_fx(graph, example_inputs)  # type: ignore[return-value]


@dataclass(frozen=True)
class StepConstants:
    """What the step bakes in: a change is a new compiled copy, never a recompilation."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    vocab_size: int | None


class DecodeSlots:
    """The device buffers of `slots` rows (see the module docstring); allocated once, reused across calls."""

    def __init__(self, model, slots: int, max_len: int, max_new_tokens: int) -> None:
        cfg = model.config
        param = next(model.parameters())
        device, dtype = param.device, cfg.params_dtype
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        groups = cfg.num_query_groups or cfg.num_attention_heads
        shape = (slots, groups, max_len, head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in model.decoder.layers]
        self.slots, self.max_len, self.max_new_tokens = slots, max_len, max_new_tokens
        self.valid = torch.zeros(slots, max_len, dtype=torch.bool, device=device)
        longs = {name: torch.zeros(slots, dtype=torch.long, device=device)
                 for name in ("position", "seed", "count", "token")}
        self.position, self.seed, self.count, self.token = (longs[n] for n in ("position", "seed", "count", "token"))
        self.finished = torch.ones(slots, dtype=torch.bool, device=device)
        self.drawn = torch.zeros(slots, max_new_tokens + 1, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(slots, max_new_tokens + 1, dtype=torch.float32, device=device)

    def fits(self, slots: int, max_len: int, max_new_tokens: int) -> bool:
        return self.slots == slots and self.max_len >= max_len and self.max_new_tokens == max_new_tokens

    def row_tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor (dim 0 = slot), caches included: what a slot move permutes."""
        return [self.valid, self.position, self.seed, self.count, self.token, self.finished, self.drawn,
                self.logprobs, *(t for kv in self.caches for t in kv)]

    def move_rows(self, source: list[int]) -> None:
        """Slot i takes slot source[i]'s row, for i < len(source) (compaction before a smaller bucket)."""
        index = torch.tensor(source, dtype=torch.long, device=self.valid.device)
        for t in self.row_tensors():
            t[: len(source)] = t[index]
        self.finished[len(source):] = True

    def reset(self) -> None:
        """Every buffer back to its allocation state (after a CUDA-graph capture's warm-up runs)."""
        for t in self.row_tensors():
            t.zero_()
        self.finished.fill_(True)


def record_draws(slots: DecodeSlots, rows: torch.Tensor, logits: torch.Tensor, const: StepConstants) -> torch.Tensor:
    """Sample rows `rows` (index tensor) of `slots` from `logits` [len(rows), V]; record token and log-prob at
    the row's draw count (a finished row's draw goes to the spare column and changes nothing); device stops set
    `finished`. Returns the drawn tokens. Used by the step and, eagerly, for a row's first draw after prefill."""
    if const.vocab_size is not None:
        logits = mask_padded_vocab(logits, const.vocab_size)
    count, live = slots.count[rows], ~slots.finished[rows]
    tokens, logprobs = sample_tokens(logits, uniform_tensor(slots.seed[rows], count), const.temperature,
                                     const.top_p, const.top_k)
    column = torch.where(live, count, const.max_new_tokens)
    slots.drawn[rows, column] = tokens
    slots.logprobs[rows, column] = logprobs
    stop = count + 1 >= const.max_new_tokens
    if const.eos_token_id is not None:
        stop = stop | (tokens == const.eos_token_id)
    for stop_id in const.stop_token_ids:
        stop = stop | (tokens == stop_id)
    slots.finished[rows] = slots.finished[rows] | (live & stop)
    slots.count[rows] = count + live.long()
    slots.token[rows] = torch.where(live, tokens, slots.token[rows])
    return tokens


class DecodeStep:
    """The decode step of one model (module docstring). `mode`: "eager", "compile" (torch.compile fullgraph,
    inductor) or "cuda_graph" (rollout/cuda_graph_step.py captures `step_function`). `compile_seconds`: time
    spent in the first run of each compiled copy (compilation plus one step)."""

    def __init__(self, model, mode: str = "eager") -> None:
        if mode not in ("eager", "compile", "cuda_graph"):
            raise ValueError(f"mode must be eager, compile or cuda_graph, got {mode!r}")
        self.model, self.mode = model, mode
        cfg = model.config
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.scale = cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.layers = list(model.decoder.layers)
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.copies: dict[tuple[int, StepConstants], Callable[..., None]] = {}
        self.compile_seconds = 0.0

    def rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin [max_len, d_rot] of the model's own RoPE freqs (as KVCacheStage)."""
        if self.tables is None or self.tables[0].shape[0] < max_len:
            freqs = self.model.rotary_pos_emb(max_len)[:, 0, 0]
            dtype = self.model.config.params_dtype
            self.tables = torch.cos(freqs).to(dtype), signed_sin(torch.sin(freqs).to(dtype))
        return self.tables

    def step_function(self, slots: DecodeSlots, bucket: int, const: StepConstants) -> Callable[[], None]:
        """A closure running one step of rows 0..bucket-1 in place (what a CUDA graph captures)."""
        cos_table, sin_table = self.rope_tables(slots.max_len)

        def step() -> None:
            self._step(slots, bucket, const, cos_table, sin_table)

        return step

    def run(self, slots: DecodeSlots, bucket: int, const: StepConstants) -> None:
        if self.mode == "eager":
            self._step(slots, bucket, const, *self.rope_tables(slots.max_len))
            return
        key = (bucket, const)
        if key not in self.copies:
            self.copies[key] = self._compiled_copy(slots, bucket, const)
        self.copies[key]()

    def _compiled_copy(self, slots: DecodeSlots, bucket: int, const: StepConstants) -> Callable[[], None]:
        if self.mode == "cuda_graph":
            from exgrpo_megatron.rollout.cuda_graph_step import capture_step

            return capture_step(self.step_function(slots, bucket, const), slots.row_tensors(), bucket)
        cos_table, sin_table = self.rope_tables(slots.max_len)
        fn = self._step.__func__  # type: ignore[attr-defined]
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, f"decode_step_b{bucket}", fn.__defaults__,
                                  fn.__closure__)  # its own code object: dynamo caches one graph per copy
        # megatron's linear layers warn (a deprecation) on every call: the compiled step skips the warning
        torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
        compiled = torch.compile(copy, fullgraph=True, dynamic=False, backend=inductor_without_host_reads)
        started = time.perf_counter()
        compiled(self, slots, bucket, const, cos_table, sin_table)  # the copy's first step: compiles, then runs
        self.compile_seconds += time.perf_counter() - started
        return lambda: compiled(self, slots, bucket, const, cos_table, sin_table)

    def _step(self, slots: DecodeSlots, bucket: int, const: StepConstants, cos_table: torch.Tensor,
              sin_table: torch.Tensor) -> None:
        model = self.model
        rows = torch.arange(bucket, device=slots.valid.device)
        position = slots.position[:bucket]
        valid = slots.valid[:bucket]
        valid[rows, position] = True
        tokens = slots.token[:bucket, None]
        hidden = model.embedding(input_ids=tokens, position_ids=position[:, None])  # [1, b, h]
        cos, sin = cos_table[position][None, :, None], sin_table[position][None, :, None]  # [1, b, 1, d_rot]
        mask = valid[:, None, None, :]
        for layer, (k_cache, v_cache) in zip(self.layers, slots.caches, strict=True):
            keys, values = k_cache[:bucket], v_cache[:bucket]

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys=keys, values=values) -> torch.Tensor:
                keys[rows, :, position] = k[0]
                values[rows, :, position] = v[0]
                return cache_attention(q, keys, values, mask, self.scale)

            hidden = layer_forward(layer, hidden, cos, sin, attend)
        if model.decoder.final_layernorm is not None:
            hidden = model.decoder.final_layernorm(hidden)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
        live = ~slots.finished[:bucket]
        record_draws(slots, rows, logits[0].float(), const)
        slots.position[:bucket] = position + live.long()
