"""Build everything one training run needs on this rank, from a validated config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exgrpo_megatron.algo.protocol import RLAlgorithm
from exgrpo_megatron.config.derived import updates_per_step
from exgrpo_megatron.config.pi_old_source import resolve_old_logprobs_for
from exgrpo_megatron.config.schema import ExperienceConfig, RootConfig
from exgrpo_megatron.config.validate import ConfigError
from exgrpo_megatron.data.datasets import PromptDataset
from exgrpo_megatron.data.sampler import PromptSampler
from exgrpo_megatron.data.synthetic import arithmetic_split_datasets
from exgrpo_megatron.data.token_cache import cached_prompt_dataset
from exgrpo_megatron.data.tokenizer import Tokenizer, load_tokenizer
from exgrpo_megatron.distributed.runtime import ParallelLayout
from exgrpo_megatron.experience.response_store import ResponseStore
from exgrpo_megatron.experience.schedule import ExperienceSchedule
from exgrpo_megatron.experience.sharded import ShardedExperiencePool
from exgrpo_megatron.policy.policy import Policy
from exgrpo_megatron.reward.answer_check import require_parsable_answers
from exgrpo_megatron.reward.grader import GraderPool
from exgrpo_megatron.rollout.types import RolloutEngine, SamplingParams
from exgrpo_megatron.training.rollout_service import RolloutService
from exgrpo_megatron.training.step_observer import StepObservers


@dataclass(frozen=True)
class StepSettings:
    """What a training step reads, resolved from the config once at start-up (the step never sees the root
    config)."""

    seed: int
    batch_size: int  # trainer.train_batch_size: question groups per step
    group_size: int  # rollout.n: K
    updates_per_step: int  # train_batch_size / ppo_mini_batch_size: mini-batch updates per pass
    update_epochs: int  # trainer.update_epochs: passes over the step's rollouts (pi_old fixed for all of them)
    micro_batch_max_tokens: int
    sequence_packing: bool
    sampling: SamplingParams  # the rollout's; its seed is set per step and round
    vocab_size: int
    skip_grad_bound: float
    max_refill_rounds: int


def step_settings(cfg: RootConfig) -> StepSettings:
    t, r = cfg.trainer, cfg.rollout
    return StepSettings(
        seed=cfg.seed, batch_size=t.train_batch_size, group_size=r.n, updates_per_step=updates_per_step(t),
        update_epochs=t.update_epochs,
        micro_batch_max_tokens=t.micro_batch_max_tokens, sequence_packing=t.sequence_packing,
        sampling=SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=r.temperature,
                                top_p=r.top_p, top_k=r.top_k, stop_strings=list(r.stop)),
        vocab_size=cfg.model.vocab_size,
        skip_grad_bound=cfg.algo.skip_grad_bound, max_refill_rounds=cfg.algo.max_refill_rounds)


@dataclass
class Components:
    cfg: RootConfig
    layout: ParallelLayout
    tokenizer: Tokenizer
    train_data: PromptDataset
    val_data: PromptDataset | None
    sampler: PromptSampler
    algorithm: RLAlgorithm  # algo.name (algo/registry.py)
    pool: ShardedExperiencePool | None  # None: on-policy (the algorithm uses no pool); settings: `pool.settings`
    schedule: ExperienceSchedule  # the phase: warm-up -> collecting -> mixed
    policy: Policy
    rollout: RolloutService  # this rank's engine + grader: generation and grading
    settings: StepSettings
    old_logprobs: str = "recompute"  # algo.old_logprobs resolved: rollout | training_forward | recompute
    dp_group: Any = None  # the data-parallel gloo group (CPU collectives), None with one DP rank
    observers: StepObservers = field(default_factory=StepObservers)  # run_training's observers (step_observer.py)
    responses: ResponseStore | None = None  # the response store (in-group / rescue replay); None: the algorithm's
    # `response_replay` is None

    def close(self) -> None:
        """Stop the processes this rank started (the grader's workers)."""
        self.rollout.close()


def build_datasets(cfg: RootConfig, tokenizer: Tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    d = cfg.data
    if d.source == "arithmetic":
        splits = arithmetic_split_datasets(d, cfg.seed, tokenizer)
        return splits["train"], splits["val"]
    kw: dict[str, Any] = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, tokenizer=tokenizer,
                              template=d.template, max_prompt_length=d.max_prompt_length)
    train = cached_prompt_dataset(d.train_files, cache_dir=d.token_cache_dir, **kw)
    val = cached_prompt_dataset(d.val_files, cache_dir=d.token_cache_dir, **kw) if d.val_files else None
    for dataset, files in ((train, d.train_files), (val, d.val_files)):  # gold answers Math-Verify cannot parse
        if dataset is not None:
            require_parsable_answers(dataset, list(files), d.max_unparsable_answers, cfg.reward.timeout_seconds)
    return train, val


def build_engine(cfg: RootConfig, policy: Policy, tokenizer: Tokenizer) -> RolloutEngine:
    """The trainer's engine on the policy's own chunks. Generating ahead, the generator process holds the configured
    engine; the trainer keeps the megatron engine on its weights for in-training validation."""
    if cfg.rollout.max_staleness > 0:
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="megatron"))
    return build_engine_for(cfg, policy.modules, tokenizer, lambda: policy.weights_version)


def build_engine_for(cfg: RootConfig, chunks: list, tokenizer: Tokenizer,
                     weights_version: Callable[[], int]) -> RolloutEngine:
    """`rollout.engine` on these model chunks (`weights_version`: bumped when their weights change)."""
    from exgrpo_megatron.rollout.factory import build_rollout_engine

    if cfg.rollout.engine == "megatron" and len(chunks) > 1:
        raise ValueError("parallel.virtual_pipeline_model_parallel_size: the megatron rollout engine needs "
                         "one model chunk per stage; use rollout.engine=vllm with virtual pipelining")
    return build_rollout_engine(
        cfg.rollout.engine, chunks, cfg.model, tokenizer, vllm=cfg.rollout.vllm, hf_dir=cfg.model.hf_path,
        seed=cfg.seed, max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        max_batch_sequences=cfg.rollout.max_batch_sequences, weights_version=weights_version,
        decode_loop=cfg.rollout.decode_loop, compile_decode=cfg.rollout.compile_decode,
        cuda_graphs=cfg.rollout.cuda_graphs, stop_check_every=cfg.rollout.stop_check_every)


def build_pool(settings: ExperienceConfig, group_size: int, dp_group: Any = None) -> ShardedExperiencePool:
    """The experience pool with the `experience` group's settings: admission / retirement / age bounds and cap,
    question selection (bucket manager, mu, sigma), trajectory selection (metric, select mode)."""
    return ShardedExperiencePool(group_size, settings, dp_group=dp_group)


def build_components(cfg: RootConfig, layout: ParallelLayout, algorithm: RLAlgorithm) -> Components:
    """The run's parts for `algorithm`, built once by the caller (registry.build_algorithm) and shared with the
    start-up block."""
    from megatron.core import parallel_state as ps

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError([f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                           f"vocabulary ({tokenizer.vocab_size})"])
    train, val = build_datasets(cfg, tokenizer)
    dp_group = ps.get_data_parallel_group_gloo() if layout.dp_size > 1 else None
    pool = build_pool(cfg.experience, cfg.rollout.n, dp_group) if algorithm.uses_pool else None
    schedule = ExperienceSchedule(cfg.experience.delayed_start_pass_rate if pool is not None else 0.0,
                                  enabled=pool is not None)
    replay_rule = algorithm.response_replay(cfg.experience)
    responses = ResponseStore(replay_rule, cfg.experience.max_age_steps, dp_group) if replay_rule else None
    policy = Policy(cfg)
    return Components(
        cfg=cfg, layout=layout, tokenizer=tokenizer, train_data=train, val_data=val,
        sampler=PromptSampler(train.qids(), seed=cfg.seed, shuffle=cfg.data.shuffle),
        algorithm=algorithm, pool=pool, schedule=schedule, policy=policy,
        rollout=RolloutService(build_engine(cfg, policy, tokenizer), GraderPool.from_config(cfg.reward), tokenizer,
                               cfg.reward.require_think),
        settings=step_settings(cfg), old_logprobs=resolve_old_logprobs_for(cfg), dp_group=dp_group,
        responses=responses,
    )
