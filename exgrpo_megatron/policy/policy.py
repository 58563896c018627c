"""The trainable policy on this rank: megatron model chunks under DDP, optimizer, LR schedule,
and one forward/backward over micro-batches on megatron's pipeline schedule.

Loss normalisation contract (NeMo-RL's; algo/loss.py computes the normalisers): the loss of each micro-batch is its
token sum divided by a *global* normaliser computed before micro-batching, so the gradient of the
mini-batch is the plain sum over micro-batches and DP ranks. Megatron is told exactly that:
`calculate_per_token_loss=True` (the schedule does not divide by the number of micro-batches),
`average_in_collective=False` with gradient scaling 1 (DDP sums), and our finalize function does
not rescale by the token count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from exgrpo_megatron.config.derived import optimizer_updates_per_step, resolve_layer_spec
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.distributed.lockstep import Lockstep
from exgrpo_megatron.distributed.threads import torch_threads, train_threads_from_env
from exgrpo_megatron.model.builder import build_gpt_model
from exgrpo_megatron.model.expert_load import ExpertLoad
from exgrpo_megatron.model.layout_init import initialise
from exgrpo_megatron.model.moe import expert_parallel_group
from exgrpo_megatron.model.routing_replay import RoutingReplay
from exgrpo_megatron.policy.batch import MicroBatch, forward_inputs
from exgrpo_megatron.policy.expert_sync import is_padding, padded_to, router_losses_off
from exgrpo_megatron.policy.output_layer import LastStageOutput, stop_before_output_layer

if TYPE_CHECKING:
    from exgrpo_megatron.checkpoint import LoadedCheckpoint

# loss_fn(last stage's output (logits or hidden states, see output_layer.py), micro_batch)
#   -> (loss scalar, metrics dict of tensors)
LossFn = Callable[[LastStageOutput, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class UpdateResult:
    grad_norm: float
    skipped: bool
    lr: float


def _finalize_grads_without_token_scaling(model: Any, num_tokens: Any = None, **kwargs: Any) -> Any:
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, num_tokens=None, **kwargs)


class Policy:
    def __init__(self, cfg: RootConfig):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.model_cfg = cfg.model  # what a loaded checkpoint's weights are checked against
        self.allow_model_changes = tuple(cfg.checkpoint.allow_model_changes)  # ... and what they may differ in
        self.sequence_packing = cfg.trainer.sequence_packing
        self.fused_output_logprobs = cfg.trainer.fused_output_logprobs
        vpp = cfg.parallel.virtual_pipeline_model_parallel_size
        stages = [None] if vpp is None else list(range(vpp))
        self.modules = [build_gpt_model(cfg.model, cfg.parallel, vp_stage=s, lora=cfg.lora) for s in stages]
        initialise(self.modules, cfg.model, cfg.seed, cfg.lora)  # same weights at every layout
        if cfg.lora.rank > 0:  # only the adapters train: no gradient buffer, no optimizer state for the base
            from exgrpo_megatron.model.lora import freeze_base

            freeze_base(self.modules)
        # megatron's local DotProductAttention is given the causal mask; sdpa and TE take None (causal kernel)
        self.use_mask = resolve_layer_spec(cfg.model) == "local" and cfg.model.core_attention == "megatron"
        self.tokens_run = self.padding_run = 0  # token slots through the model / of them padding, since taken
        self._counting_load = False  # forward_backward of a training update: the MoE routers' loads are counted
        # called with (site, micro_batches, forward_only) before every pass that runs on this rank (the trainer's
        # observers: step_observer.py)
        self.pass_observers: list[Callable[[str, list[MicroBatch], bool], None]] = []
        tcfg = self.modules[0].config
        tcfg.variable_seq_lengths = True  # micro-batches differ in length and rows
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.chunks = [
            DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=m) for m in self.modules
        ]
        tcfg.finalize_model_grads_func = _finalize_grads_without_token_scaling
        tcfg.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        tcfg.grad_sync_func = None
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                clip_grad=o.clip_grad, bf16=tcfg.bf16, params_dtype=tcfg.params_dtype,
                use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            ),
            self.chunks,
        )
        decay_steps = max(1, cfg.trainer.total_steps * optimizer_updates_per_step(cfg.trainer))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=o.lr_schedule, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant",
        )
        self.weights_version = 0  # bumped on every change of the weights; see mark_weights_changed
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.train_threads = train_threads_from_env(cfg.trainer.train_threads, dist.get_world_size())
        # MoE with EP > 1: the EP ranks hold different data but run every forward together (distributed/lockstep.py)
        self.ep_group = expert_parallel_group(self.modules[0])
        self.lockstep = Lockstep(self.ep_group)
        self.expert_load = ExpertLoad(self.modules)  # MoE: tokens per expert of the training updates
        # MoE: the engine records each token's experts; every pass compares (and with moe_routing_replay replays) them
        self.routing = RoutingReplay(self.modules, replay=cfg.model.moe_routing_replay)

    # ---------------------------------------------------------------- weights
    def mark_weights_changed(self) -> None:
        """The one signal that the weights changed: every load below and every applied optimizer update
        bumps `weights_version`, and a rollout engine holding its own copy (vLLM) refits before it next
        generates when the version differs from its last refit (rollout/vllm_engine.py)."""
        self.weights_version += 1

    def load_weights(self, path: str | Path) -> None:
        """Weights only (`checkpoint.init_from`, the SFT warm start); the optimizer's master copy follows."""
        from exgrpo_megatron.checkpoint import load_model_weights

        load_model_weights(path, self.modules, model_config=self.model_cfg,
                           allow_model_changes=self.allow_model_changes)
        self.optimizer.reload_model_params()
        self.mark_weights_changed()

    def load_adapters(self, full: dict[str, torch.Tensor]) -> None:
        """LoRA adapters from full (TP=1) tensors by global name (`lora.init_from`); the optimizer's copy follows."""
        from exgrpo_megatron.model.lora import load_adapters

        load_adapters(self.modules, full)
        self.optimizer.reload_model_params()
        self.mark_weights_changed()

    def resume(self, run_dir: str, resume: str) -> LoadedCheckpoint | None:
        """`checkpoint.resume` -> the newest trainer checkpoint that verifies (weights, optimizer, LR schedule,
        RNG), loaded; returns its LoadedCheckpoint, or None when there is none to resume from."""
        from exgrpo_megatron.checkpoint import load_newest_verified

        loaded = load_newest_verified(run_dir, resume, model_chunks=self.modules, model_config=self.model_cfg,
                                      optimizer=self.optimizer, opt_param_scheduler=self.scheduler,
                                      allow_model_changes=self.allow_model_changes)
        if loaded is not None:
            self.mark_weights_changed()
        return loaded

    # ---------------------------------------------------------------- forward / backward
    def _forward_step(self, loss_fn: LossFn, collect: list[dict[str, torch.Tensor]],
                      data_iterator: Iterator[MicroBatch], model: Any
                      ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[Any, ...]]]:
        mb: MicroBatch = next(data_iterator)
        with stop_before_output_layer(model, self.fused_output_logprobs) as output_weight, \
                (router_losses_off(self.modules[0].config) if is_padding(mb) else nullcontext()), \
                self.expert_load.counting(self._counting_load and not is_padding(mb)):
            # kept until the next micro-batch's forward: a backward recompute of this one routes as its forward did
            self.routing.set_targets(tuple(mb.tokens.shape), mb.row_starts, mb.expert_choices,
                                     count=self._counting_load and not is_padding(mb))
            output = model(**forward_inputs(mb, causal_mask=self.use_mask))

        def loss_func(model_output: torch.Tensor) -> tuple[Any, ...]:
            loss, metrics = loss_fn(LastStageOutput(model_output, output_weight), mb)
            if not is_padding(mb):
                collect.append({k: v.detach() for k, v in metrics.items()})
            return loss, torch.tensor(mb.num_tokens, dtype=torch.int), {}

        return output, loss_func

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn, forward_only: bool = False, *,
                         site: str) -> list[dict[str, torch.Tensor]]:
        """Run the megatron schedule over the micro-batches; returns the loss_fn metrics of each
        micro-batch on every pipeline stage (broadcast from the last stage).

        The one entry of every model pass (`site` names it, distributed/lockstep.py). Every rank calls it at every pass
        site, with its own micro-batches, possibly none: under expert parallelism the ranks agree on the count and
        pad to it; a training pass with none here joins the others' gradient sync with one padding micro-batch; all
        return [] when every rank's list is empty (a forward-only pass at EP = 1: when this rank's is)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        count = self.lockstep.agree(site, len(micro_batches), gradient_sync=not forward_only)
        if count == 0:
            return []
        for observe in self.pass_observers:
            observe(site, micro_batches, forward_only)
        device = next(self.modules[0].parameters()).device
        if self.lockstep.expert_parallel or not micro_batches:
            micro_batches = padded_to(micro_batches, count if self.lockstep.expert_parallel else 1,
                                      self.sequence_packing)
        micro_batches = [mb.to(device) for mb in micro_batches]
        self.tokens_run += sum(mb.tokens.numel() for mb in micro_batches)
        self.padding_run += sum(mb.padding_tokens for mb in micro_batches)
        collect: list[dict[str, torch.Tensor]] = []
        self._counting_load = not forward_only
        n = len(micro_batches)
        iterators = [iter(micro_batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro_batches)
        with torch_threads(self.train_threads), self.routing.pass_scope():  # this rank's cores (distributed/threads.py)
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn, collect),
                data_iterator=iterators,
                model=self.chunks,
                num_microbatches=n,
                seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
                micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        return self._broadcast_from_last_stage(collect, len(collect))

    def _broadcast_from_last_stage(self, collect: list[dict[str, torch.Tensor]], n: int
                                   ) -> list[dict[str, torch.Tensor]]:
        if dist.get_world_size(self.pp_group) == 1:
            return collect
        payload: list[list[dict[str, torch.Tensor]] | None] = [collect] if self.is_last_stage else [None]
        dist.broadcast_object_list(payload, src=self.pp_last_rank, group=self.pp_group)
        return cast(list[dict[str, torch.Tensor]], payload[0])  # filled by the broadcast

    def take_padding_share(self) -> float:
        """Share of the token slots run through the model since the last call that were padding."""
        share = self.padding_run / self.tokens_run if self.tokens_run else 0.0
        self.tokens_run = self.padding_run = 0
        return share

    # ---------------------------------------------------------------- optimizer
    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self, skip_grad_bound: float) -> UpdateResult:
        """Step unless the global grad norm is non-finite or above `skip_grad_bound`
        (the original's `skip_grad_bound`, 500): a skipped update leaves weights and Adam state."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        grad_norm = math.inf if found_inf else float(self.optimizer.get_grad_norm())
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(grad_norm) or grad_norm > skip_grad_bound:
            return UpdateResult(grad_norm=grad_norm, skipped=True, lr=lr)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params:
                clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm)
        self.optimizer.step_with_ready_grads()
        self.mark_weights_changed()
        self.scheduler.step(increment=1)
        return UpdateResult(grad_norm=grad_norm, skipped=False, lr=lr)

    def train(self) -> None:
        for c in self.chunks:
            c.train()

    def eval(self) -> None:
        for c in self.chunks:
            c.eval()

