"""The typed configuration schema: one dataclass per config group in conf/.

Every field is documented in conf/ next to its default. `CHOICES` is the one list of the allowed values
of every string key with a fixed set of values (validation, the prompt templates, the engine factory and
the CLIs read it); config/domains.py declares the range of every numeric key, and `validate()` checks the
relations between fields at start-up, before any process group exists, naming the offending key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from exgrpo_megatron.config.families import FAMILIES

# The linears of a layer that LoRA can adapt (megatron-core's names): column-parallel qkv and MLP-in,
# row-parallel attention output and MLP-out.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class ModelConfig:
    name: str = "tiny_qwen2"
    family: str = "qwen2"  # a key of config/families.py FAMILIES: qwen2 | llama | qwen3 | qwen3_moe
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: Optional[int] = None
    vocab_size: int = 128
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 256
    rope_theta: float = 1000000.0
    rope_scaling_factor: Optional[float] = None  # Llama 3.1 RoPE scaling (8.0)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    params_dtype: str = "auto"  # auto (bf16 on GPU; CPU: machine/cpu_precision.py) | fp32 | bf16
    layer_spec: str = "auto"  # auto (TE when importable with CUDA) | te | local
    core_attention: str = "sdpa"  # local spec: sdpa (torch fused kernel) | megatron (DotProductAttention)
    fused_norm_rope: bool = True  # local spec: RMSNorm and RoPE as one autograd function each (model/fused_ops.py)
    recompute_activations: bool = False
    # Mixture of experts (model/moe.py); num_experts = 0 is a dense model and the moe_* keys are not read.
    num_experts: int = 0
    moe_ffn_hidden_size: Optional[int] = None  # each expert's SwiGLU intermediate size (HF moe_intermediate_size)
    moe_router_topk: int = 2  # experts per token (HF num_experts_per_tok)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1 (HF norm_topk_prob)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (HF router_aux_loss_coef)
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient; 0 = off
    moe_grouped_gemm: bool = False  # GPU (TE spec): all local experts in one grouped GEMM
    moe_token_dispatcher: str = "allgather"  # allgather | alltoall (GPU at scale) | flex (DeepEP, GPU)
    moe_routing_replay: bool = False  # train on the experts the rollout routed each token to (model/routing_replay.py)
    hf_path: Optional[str] = None  # HF directory: tokenizer files (and weights for conversion)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    expert_model_parallel_size: int = 1  # EP: the experts split over this many ranks (MoE models)
    expert_tensor_parallel_size: int = 1  # ETP: each expert's weights split over this many ranks (MoE models)
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run, exit 5 (collective_watch.py)
    collective_ledger: bool = False  # debug: ranks compare the collectives they issue (collective_ledger.py)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | linear
    lr_warmup_steps: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class VllmConfig:
    gpu_memory_utilization: float = 0.5  # share of GPU memory (RAM on vLLM's CPU build) for weights + KV cache
    refit_bucket_mb: int = 512  # size of one weight-refit bucket
    enforce_eager: bool = False  # true: no CUDA graphs / torch.compile (fast start-up; the CPU build needs it)
    dtype: str = "auto"  # auto (the policy's parameter dtype) | fp32 | bf16 | fp16
    max_model_len: Optional[int] = None  # None = data.max_prompt_length + data.max_response_length
    sleep_level: int = 1  # 1: offload weights, drop KV cache | 2: drop both (no-op where vLLM has no sleep mode)


@dataclass
class GeneratorConfig:
    """The generation process of a run one or more steps off (rollout.max_staleness > 0)."""

    device: str = "auto"  # auto (cpu; on GPU the first device after the node's trainer ranks) | cpu | cuda:N
    threads: int = 0  # its torch threads; 0 = torch's default
    cpu_cores: list[int] = field(default_factory=list)  # pin it to these cores (empty: inherit the launcher's)
    startup_timeout_seconds: float = 900.0  # start-up and the first round must end within this (async_generation/)
    deadline_factor: float = 10.0  # then each round within this x the slowest round measured so far ...
    deadline_min_seconds: float = 120.0  # ... and never less than this


@dataclass
class RolloutConfig:
    engine: str = "megatron"  # megatron | vllm
    n: int = 8  # K rollouts per question
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    max_batch_sequences: int = 64  # megatron engine: sequences decoded together
    decode_loop: str = "auto"  # megatron engine: chunked | continuous | auto (continuous on CUDA where it runs)
    compile_decode: bool = False  # continuous loop off CUDA graphs: torch.compile(fullgraph) the decode step
    cuda_graphs: str = "auto"  # continuous loop: auto (on with CUDA) | true (CUDA only) | false
    stop_check_every: int = 4  # continuous loop: the host reads the rows' stops every this many decode steps
    val_temperature: float = 0.6
    val_top_p: float = 1.0
    vllm: VllmConfig = field(default_factory=VllmConfig)  # rollout.engine=vllm only
    max_staleness: int = 0  # 0: generate then train (colocated); s > 0: a generator process runs s steps ahead
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)  # max_staleness > 0 only


@dataclass
class AlgoConfig:
    name: str = "exgrpo"  # a registered variant (algo/variants/: exgrpo | grpo | ...) or package.module:Class
    adv_std_normalize: bool = False  # Dr.GRPO: no std division
    ratio: str = "token"  # fresh tokens' importance ratio: token | sequence (GSPO's, per sequence)
    clip_ratio: float = 0.2  # PPO clip on fresh tokens during warm-up: ratio >= 1 - clip_ratio
    clip_ratio_high: float | None = None  # ... and ratio <= 1 + clip_ratio_high; None = clip_ratio (DAPO: 0.28)
    entropy_coeff: float = 0.001
    loss_agg_mode: str = "token_sum_constant"  # token_sum_constant | token_mean | seq_mean
    old_logprobs: str = "auto"  # auto | rollout | training_forward | recompute (config/pi_old_source.py)
    skip_grad_bound: float = 500.0
    max_consecutive_skips: int = 20
    loss_seqs_per_rank_ref: float = 64.0  # token_sum_constant: the original's sequences per rank (64x8 seqs / 8 GPUs)
    entropy_microbatches_ref: float = 4.0  # entropy bonus x this: the original's dynamic micro-batches per rank
    max_refill_rounds: int = 3  # extra generation rounds refilling groups the algorithm's filter dropped
    fresh_is_cap: float = 0.0  # fresh tokens x min(pi_old / pi_behaviour, cap) (truncated IS); 0 = off
    surrogate: str = "ppo_clip"  # algo.name=exgrpo: the surrogate by name (algo/surrogates.py): ppo_clip | cispo | ...
    # the selected variant's own settings, declared in its file (algo/settings.py; e.g. algo/variants/exgrpo.py)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExperienceConfig:
    """The experience pool's settings (conf/experience/; read with algo.name=exgrpo), one object the pool, the step
    plan and the schedule read."""

    ratio: float = 0.5  # rho: replayed questions per step = floor(rho * B)
    placement: str = "displace"  # displace: B - n_exp fresh questions + n_exp replayed | append: B fresh + n_exp
    delayed_start_pass_rate: float = 0.35  # mixed mode once a step's solved fraction exceeds this; <= 0: step 1
    # a question (k of its K responses correct) enters the pool iff admit_correct_above < k <= admit_correct_at_most;
    # once in, a group with admit_correct_above < k <= retire_correct_above moves it to bucket k and adds its correct
    # trajectories; k > retire_correct_above retires it (null: K - 1, only all-correct groups retire)
    admit_correct_above: int = 0
    admit_correct_at_most: int = 7
    retire_correct_above: Optional[int] = None
    max_age_steps: int = 0  # a trajectory collected at step s is replayed through step s + this at most; 0 = no bound
    max_trajectories_per_question: int = 0  # 0 = no cap (paper); else keep the newest N
    bucket_manager: str = "normal"  # question selection: normal | uniform | linear | sqrt
    bucket_mu: float = 0.5
    bucket_sigma: float = 1.0
    metric: str = "ent"  # trajectory selection: ent | ppl | random
    select_mode: str = "argmin"  # argmin (lowest ent/ppl, paper) | argmax (highest: Tab. 6 ablation)
    # the response store (algo.name=ingroup_replay | rescue_replay; experience/response_store.py)
    ingroup_size: int = 8  # r: stored responses a fresh group gains at most (ingroup_replay)
    ingroup_failures: bool = True  # store and replay failures too (false: successes only, as RLEP)
    pool_file_in: Optional[str] = None  # start from this pool file's store (written by another run); None: empty
    pool_file_out: Optional[str] = None  # write the store to this file with every checkpoint; None: not written

    def retire_above(self, group_size: int) -> int:
        """k above which a question retires: retire_correct_above, or K - 1 when unset."""
        return group_size - 1 if self.retire_correct_above is None else self.retire_correct_above


@dataclass
class TrainerConfig:
    total_steps: int = 701
    train_batch_size: int = 128  # prompts per step (B)
    ppo_mini_batch_size: int = 64  # prompts per optimizer update (paper: 2 updates per step)
    update_epochs: int = 1  # passes over the step's rollouts, each in the same mini-batch updates (verl's ppo_epochs)
    micro_batch_max_tokens: int = 32768  # token budget of one micro-batch on one rank
    sequence_packing: bool = True  # pack rows into one [1, tokens] sequence (THD) instead of right-padding
    fused_output_logprobs: bool = True  # output layer fused into the chunked log-prob/entropy (no [T, V] logits)
    train_threads: int = 0  # policy forward/backward threads; 0 = cores // ranks on the node (distributed/threads.py)
    val_every: int = 10
    val_n: int = 1  # avg@k on the validation set
    sft_warm_start_steps: int = 0  # synthetic task only: supervised warm-start steps before RL (cached)
    sft_warm_start_lr: float = 1e-3
    sft_warm_start_examples: int = 0  # warm-start corpus size; 0 = data.num_train_examples (policy/warm_start.py)
    sft_cache_dir: str = ".cache/sft_warm_start"


@dataclass
class DataConfig:
    source: str = "files"  # files | arithmetic (the built-in synthetic task)
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    max_prompt_length: int = 1024
    max_response_length: int = 8192
    template: str = "own"  # own | chat | llama_base | plain | chat_direct
    tokenizer: str = "hf"  # hf (model.hf_path) | char (built-in character tokenizer)
    shuffle: bool = True
    num_val_examples: int = 64  # synthetic task only
    num_train_examples: int = 2048  # synthetic task only
    token_cache_dir: str = ".cache/tokenized_prompts"  # tokenised files cached here (data/token_cache.py); "" = off
    max_unparsable_answers: float = 0.05  # refuse a data set with more gold answers Math-Verify cannot parse
    num_test_examples: int = 0  # synthetic task only: held-out test split (its own seed), read by the bench
    arithmetic_tiers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # synthetic task: tiers used


@dataclass
class RewardConfig:
    timeout_seconds: int = 5  # Math-Verify parse/verify timeout (whole seconds >= 1)
    hard_deadline_seconds: float = 30.0  # a worker past this is killed, its item scores 0
    num_workers: int = 2
    require_think: bool = True


@dataclass
class CheckpointConfig:
    save_every: int = 50
    keep_last: int = 2
    resume: str = "auto"  # auto | none | <path>
    init_from: Optional[str] = None  # megatron checkpoint (from tools/convert_hf_to_megatron.py)
    allow_config_change: list[str] = field(default_factory=list)  # keys a resume may change although refused
    allow_model_changes: list[str] = field(default_factory=list)  # model fields a checkpoint may differ in (by name)


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    tensorboard: bool = True
    wandb_project: Optional[str] = None
    progress_bar: bool = True


@dataclass
class LoraConfig:
    rank: int = 0  # r of the adapters; 0 = off (full fine-tuning)
    alpha: float = 16.0  # the update is B A x * alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input while the policy is in training mode
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # linears given adapters, by name
    experts: bool = False  # MoE: the experts' linear_fc1/fc2 get adapters too (false: attention only)
    init: str = "kaiming"  # A's initialisation: kaiming (uniform, +-1/sqrt(fan_in)) | gaussian (std 1/rank); B = 0
    init_from: Optional[str] = None  # a PEFT adapter directory the adapters start from (a fresh run; not a resume)


@dataclass
class RootConfig:
    seed: int = 1234
    dry_run: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    experience: ExperienceConfig = field(default_factory=ExperienceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# The allowed values of the string keys with a fixed set of values (the defaults above are among them).
CHOICES: dict[str, tuple[str, ...]] = {
    "model.family": tuple(FAMILIES),
    "model.params_dtype": ("auto", "fp32", "bf16"),
    "model.layer_spec": ("auto", "te", "local"),
    "model.core_attention": ("sdpa", "megatron"),
    "model.moe_token_dispatcher": ("allgather", "alltoall", "flex"),
    "optim.lr_schedule": ("constant", "cosine", "linear"),
    "rollout.engine": ("megatron", "vllm"),
    "rollout.decode_loop": ("auto", "chunked", "continuous"),
    "rollout.vllm.dtype": ("auto", "fp32", "bf16", "fp16"),
    "algo.loss_agg_mode": ("token_sum_constant", "token_mean", "seq_mean"),
    "algo.ratio": ("token", "sequence"),
    "algo.old_logprobs": ("auto", "rollout", "training_forward", "recompute"),
    "experience.placement": ("displace", "append"),
    "experience.metric": ("ent", "ppl", "random"),
    "experience.bucket_manager": ("normal", "uniform", "linear", "sqrt"),
    "experience.select_mode": ("argmin", "argmax"),
    "data.source": ("files", "arithmetic"),
    "data.template": ("own", "chat", "llama_base", "plain", "chat_direct"),
    "data.tokenizer": ("hf", "char"),
    "lora.init": ("kaiming", "gaussian"),
}

_DATA = "the training prompts: the sampler's position and the pool's question ids refer to the saved data set"
_BATCH = ("the batch, prompts per step and per optimizer update (the refusal says which, and what follows: "
          "config/resume_changes.batch_change)")
_POOL_BOUND = "which questions the pool keeps (the saved pool was filtered with the old bound)"
# The keys a resume refuses to change (config/resume_changes.py) -> what they would change; allowed only when
# listed in checkpoint.allow_config_change.
RESUME_REFUSED: dict[str, str] = {
    "algo.name": "switches the experience pool on or off: the saved pool would be dropped, or an empty one started",
    "rollout.max_staleness": "the checkpoint holds the rollouts in flight for the saved staleness",
    "rollout.n": "the group size K: the pool's k-of-K records and buckets were counted for the saved K",
    "experience.admit_correct_above": _POOL_BOUND, "experience.admit_correct_at_most": _POOL_BOUND,
    "experience.retire_correct_above": _POOL_BOUND,
    "experience.max_trajectories_per_question": "the cap the saved pool was filled under",
    "trainer.train_batch_size": _BATCH,
    "trainer.ppo_mini_batch_size": _BATCH,
    "trainer.update_epochs": "the optimizer updates per step: the LR schedule's progress (counted in updates) would "
                             "no longer match the step count",
    "seed": "the prompt order and every step's sampling seed derive from it",
    "data.source": _DATA, "data.train_files": _DATA, "data.prompt_key": _DATA, "data.answer_key": _DATA,
    "data.template": _DATA, "data.tokenizer": _DATA, "data.max_prompt_length": _DATA, "data.shuffle": _DATA,
    "data.num_train_examples": _DATA, "data.arithmetic_tiers": _DATA,
}
