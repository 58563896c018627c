"""The generator process of a run generating ahead of training (`rollout.max_staleness` > 0).

A process of its own (started by the trainer's global rank 0, schedule.py): its own one-rank world with a
TP=1 copy of the policy's model (no optimizer; with LoRA a model without adapters, sent the merged weights), the
configured rollout engine on it (`rollout.engine`: the megatron KV-cache engine, or vLLM refitted from this copy)
and its own grader pool. It serves requests over the link (link.py) one at a time, in order: a request carries one
step's question groups and, when the
trainer's weights changed since the last request, those weights (full TP=1 tensors, bucket by bucket); the
answer is the step's samples and rewards, generated at the step's own seed (rollout_service.py), so the rollouts
of a step depend only on its groups and the weights it names -- never on timing.

Signals: it ignores SIGTERM / SIGUSR1 / SIGINT as the grader's workers do -- Slurm signals every process of the job
step at preemption, and the trainer, which handles them, still needs the generator to finish the step and the
preemption save -- and it is killed when the trainer dies (distributed/lifetime.py). The trainer watches it
(watch.py): a generator that dies or misses its deadline is named and the run stops.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import torch

from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.rollout.refit import unflatten
from exgrpo_megatron.rollout.types import Sample
from exgrpo_megatron.training.async_generation.link import GENERATOR, Link

WeightBucket = tuple[list[tuple[str, tuple[int, ...]]], torch.dtype]  # ((name, full shape) of each tensor, dtype)


@dataclass
class RolloutRequest:
    step: int  # the training step these rollouts are for
    groups: list[QuestionGroup]  # the step's whole batch (every DP rank's share)
    weights_step: int  # the weights to generate with: the policy's after this many training steps
    weight_buckets: list[WeightBucket] | None  # new weights follow as one flat tensor per bucket; None: unchanged


@dataclass
class RolloutResult:
    step: int
    samples: list[list[Sample]]  # per group, in the request's order
    rewards: list[list[float]]
    weights_step: int
    generate_seconds: float  # generation + grading not overlapped with it, in the generator
    load_seconds: float  # receiving and loading the weights
    grader_timeouts: int
    grader_worker_deaths: int


def generator_parallel(cfg: RootConfig) -> RootConfig:
    """The generator's config: the run's, on one rank (TP = PP = CP = 1, no virtual stages)."""
    p = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
                            sequence_parallel=False)
    return dataclasses.replace(cfg, parallel=p)


def load_full_weights(params: dict[str, torch.nn.Parameter], named: list[tuple[str, torch.Tensor]]) -> None:
    """Copy full (TP=1-layout) tensors into the model's parameters by global name. The vocabulary rows are padded
    to a multiple that depends on the trainer's TP, so an embedding or output layer copies the rows both have (the
    padding rows are never sampled: rollout/sampling.py masks ids >= the real vocabulary)."""
    with torch.no_grad():
        for name, tensor in named:
            p = params[name]
            if p.shape == tensor.shape:
                p.copy_(tensor)
            elif p.shape[1:] == tensor.shape[1:]:
                rows = min(p.shape[0], tensor.shape[0])
                p[:rows].copy_(tensor[:rows])
            else:
                raise ValueError(f"{name}: trainer sent shape {tuple(tensor.shape)}, generator has {tuple(p.shape)}")


def receive_weights(link: Link, buckets: list[WeightBucket], params: dict[str, torch.nn.Parameter]) -> None:
    for metas, dtype in buckets:
        flat = link.recv_tensor(sum(math.prod(shape) for _, shape in metas), dtype)
        load_full_weights(params, list(unflatten(flat, metas)))


def serve(cfg: RootConfig, host: str, port: int, device_index: int | None, trainer: tuple[int, bool]) -> None:
    """The process's body: set up, announce readiness, answer requests until the trainer sends None. `trainer`: the
    trainer's lifetime.parent_token()."""
    from exgrpo_megatron.distributed.lifetime import die_with_parent
    from exgrpo_megatron.reward.grader_worker import ignore_preemption_signals

    die_with_parent(*trainer)  # the trainer's death takes the generator (and through it its grader) along
    ignore_preemption_signals()  # Slurm signals the whole job step: the trainer saves, then closes the link
    link = Link(host, port, GENERATOR)  # first: a failure below closes it, and the trainer's receive raises
    g = cfg.rollout.generator
    if g.cpu_cores:
        os.sched_setaffinity(0, g.cpu_cores)
    if g.threads:
        torch.set_num_threads(g.threads)
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.launch_env import LaunchEnv, free_local_port
    from exgrpo_megatron.distributed.runtime import destroy_distributed, init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.param_layout import named_global_params
    from exgrpo_megatron.reward.grader import GraderPool
    from exgrpo_megatron.reward.rollout_rewards import rewards_per_group
    from exgrpo_megatron.training.components import build_engine_for, step_settings
    from exgrpo_megatron.training.rollout_service import RolloutService

    own = LaunchEnv(0, 1, device_index or 0, "127.0.0.1", free_local_port(), "single")
    os.environ.update(MASTER_ADDR=own.master_addr, MASTER_PORT=str(own.master_port))  # not the trainer's world
    cfg = generator_parallel(cfg)
    init_distributed(1, 1, None, 1, seed=cfg.seed, env=own)
    model = build_gpt_model(cfg.model, cfg.parallel)
    model.eval()
    params = dict(named_global_params([model], tied_copy=False))
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    version = [0]
    service = RolloutService(build_engine_for(cfg, [model], tokenizer, lambda: version[0]),
                             GraderPool.from_config(cfg.reward), tokenizer, cfg.reward.require_think)
    s = step_settings(cfg)
    try:
        link.send_object("ready")
        while (request := link.recv_object()) is not None:
            start = time.perf_counter()
            if request.weight_buckets is not None:
                receive_weights(link, request.weight_buckets, params)
                version[0] += 1  # vLLM refits from the copy before it next generates
            loaded = time.perf_counter()
            generated = service.training_round(request.groups, s.group_size, s.sampling, s.seed, request.step)
            graded = generated.grading.result()
            rewards = rewards_per_group(graded.rewards, generated.samples)
            link.send_object(RolloutResult(request.step, generated.samples, rewards, request.weights_step,
                                           time.perf_counter() - loaded, loaded - start, graded.n_timeouts_killed,
                                           graded.n_worker_deaths))
    finally:
        service.close()
        destroy_distributed()
