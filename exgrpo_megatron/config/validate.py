"""Start-up validation of a resolved `RootConfig`: every error names its key and the reason.

Runs before any process group exists (the world size comes from the launcher's environment or
the dry run's `--world-size`). The domain of every numeric key, the choices of every string key
(schema.CHOICES) and the paths the run reads are checked in config/domains.py; the relations between
keys are checked here. A key whose value is out
of its domain gets that one error (the relations involving it are not reported on top).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from exgrpo_megatron.config.derived import padded_vocab_size, resolve_layer_spec
from exgrpo_megatron.config.domains import domain_errors, path_errors
from exgrpo_megatron.config.families import FAMILIES
from exgrpo_megatron.config.model_function import allow_model_changes_errors
from exgrpo_megatron.config.moe_checks import moe_config_errors
from exgrpo_megatron.config.pi_old_source import resolve_old_logprobs_for
from exgrpo_megatron.config.schema import CHOICES, LORA_TARGETS, AlgoConfig, ExperienceConfig, RootConfig


class ConfigError(ValueError):
    """An invalid configuration; the message lists `key: reason` lines."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid configuration:\n  " + "\n  ".join(errors))


def config_errors(cfg: RootConfig, world_size: int) -> list[str]:
    """The relations between keys (each key's own domain and choices are domains.domain_errors'). The
    guards against zero keep this total for out-of-domain values, whose relation errors all_errors drops."""
    e: list[str] = []
    m, p, t, d, rw = cfg.model, cfg.parallel, cfg.trainer, cfg.data, cfg.reward
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size

    if t.sequence_packing and m.layer_spec != "te" and m.core_attention != "sdpa":
        e.append("trainer.sequence_packing: the local layer spec packs sequences with model.core_attention=sdpa only")
    if t.sequence_packing and cp > 1:
        e.append("trainer.sequence_packing: not implemented with context_parallel_size > 1 (set it false)")
    if m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads and m.kv_channels is None:
        e.append(f"model.hidden_size: {m.hidden_size} not divisible by num_attention_heads {m.num_attention_heads} "
                 "(set model.kv_channels)")
    if m.rope_scaling_factor is not None and m.family in FAMILIES and "llama3" not in FAMILIES[m.family].rope_scaling:
        e.append(f"model.rope_scaling_factor: the {m.family} family has no llama3 RoPE scaling (set it null)")
    if m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups:
        e.append(f"model.num_query_groups: {m.num_attention_heads} heads not divisible by {m.num_query_groups} groups")

    if tp > 0 and m.num_attention_heads % tp:
        e.append(f"parallel.tensor_model_parallel_size: model.num_attention_heads={m.num_attention_heads} "
                 f"is not divisible by TP={tp}")
    if tp > 0 and m.num_query_groups % tp:
        e.append(f"parallel.tensor_model_parallel_size: model.num_query_groups={m.num_query_groups} "
                 f"is not divisible by TP={tp}")
    if tp > 0 and m.make_vocab_size_divisible_by > 0:
        padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
        if padded % tp:
            e.append(f"model.make_vocab_size_divisible_by: padded vocab {padded} is not divisible by TP={tp}")
    if tp > 0 and m.ffn_hidden_size % tp:
        e.append(f"parallel.tensor_model_parallel_size: model.ffn_hidden_size={m.ffn_hidden_size} not divisible by TP")
    if pp > 0 and m.num_layers % (pp * (p.virtual_pipeline_model_parallel_size or 1)):
        e.append(f"parallel.pipeline_model_parallel_size: model.num_layers={m.num_layers} is not divisible by "
                 f"PP={pp} x VPP={p.virtual_pipeline_model_parallel_size or 1}")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pp == 1:
        e.append(f"parallel.virtual_pipeline_model_parallel_size: VPP={vpp} needs pipeline_model_parallel_size > 1 "
                 "(with PP=1 megatron places every model chunk at layer offset 0)")
    model_parallel = tp * pp * cp
    if model_parallel > 0 and world_size % model_parallel:
        e.append(f"parallel: world size {world_size} is not divisible by TP x PP x CP = {model_parallel}")
    dp = world_size // model_parallel if model_parallel > 0 and world_size % model_parallel == 0 else 0
    if p.sequence_parallel and tp == 1:
        e.append("parallel.sequence_parallel: requires tensor_model_parallel_size > 1")

    e.extend(moe_config_errors(cfg, world_size))
    e.extend(allow_model_changes_errors(cfg.checkpoint.allow_model_changes))
    e.extend(vllm_config_errors(cfg))
    e.extend(decode_loop_errors(cfg))
    e.extend(_old_logprobs_errors(cfg))
    e.extend(staleness_errors(cfg))
    e.extend(lora_errors(cfg))

    if t.ppo_mini_batch_size > 0 and t.train_batch_size % t.ppo_mini_batch_size:
        e.append(f"trainer.ppo_mini_batch_size: train_batch_size={t.train_batch_size} is not divisible by "
                 f"{t.ppo_mini_batch_size}")
    if dp and t.ppo_mini_batch_size % dp:
        e.append(f"trainer.ppo_mini_batch_size: {t.ppo_mini_batch_size} prompts not divisible by DP size {dp}")
    e.extend(experience_errors(cfg))
    if t.micro_batch_max_tokens < d.max_prompt_length + d.max_response_length:
        e.append(f"trainer.micro_batch_max_tokens: {t.micro_batch_max_tokens} is smaller than one full sequence "
                 f"(data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length})")

    if t.sft_warm_start_steps > 0 and d.source != "arithmetic":
        e.append("trainer.sft_warm_start_steps: the supervised warm start needs data.source=arithmetic")
    if not d.arithmetic_tiers or any(tier not in range(8) for tier in d.arithmetic_tiers):
        e.append(f"data.arithmetic_tiers: need a non-empty list of tiers from 0..7, got {d.arithmetic_tiers}")
    if d.source == "files" and not d.train_files:
        e.append("data.train_files: empty; give parquet/JSONL files (tools/prepare_data.py makes them)")
    if d.tokenizer == "hf" and not m.hf_path:
        e.append("model.hf_path: required when data.tokenizer=hf (the tokenizer is loaded from it, offline)")
    if d.max_prompt_length + d.max_response_length > m.max_position_embeddings:
        e.append(f"data.max_response_length: prompt + response = {d.max_prompt_length + d.max_response_length} "
                 f"exceeds model.max_position_embeddings = {m.max_position_embeddings}")

    if isinstance(rw.timeout_seconds, bool) or not isinstance(rw.timeout_seconds, int):
        e.append(f"reward.timeout_seconds: must be a whole number of seconds >= 1 (Math-Verify uses signal.alarm), "
                 f"got {rw.timeout_seconds!r}")
    if rw.hard_deadline_seconds <= rw.timeout_seconds:
        e.append("reward.hard_deadline_seconds: must exceed reward.timeout_seconds")
    return e


def experience_errors(cfg: RootConfig) -> list[str]:
    """The pool's thresholds against K (experience/shard.py); the replay term's settings are ExGRPO's own checks."""
    x, k, e = cfg.experience, cfg.rollout.n, list[str]()
    retire = x.retire_above(k)
    if not 0 <= x.admit_correct_above < x.admit_correct_at_most <= retire < k:
        e.append(f"experience.admit_correct_at_most: need 0 <= admit_correct_above ({x.admit_correct_above}) < "
                 f"admit_correct_at_most ({x.admit_correct_at_most}) <= retire_correct_above ({retire}) < "
                 f"rollout.n ({k})")
    return e


# the response store's experience.* keys (experience/response_store.py): read only by the variants that declare them
RESPONSE_STORE_KEYS = ("ingroup_size", "ingroup_failures", "max_age_steps", "pool_file_in", "pool_file_out")


def response_store_key_errors(x: ExperienceConfig, algo_name: str, reads: frozenset[str], uses_pool: bool
                              ) -> list[str]:
    """A response-store key set away from its default for a variant that does not read it (`reads`: the variant's
    `experience_keys`; the experience pool reads experience.max_age_steps too, `uses_pool`)."""
    default = ExperienceConfig()
    read = reads | ({"max_age_steps"} if uses_pool else set())
    return [f"experience.{key}: {getattr(x, key)!r} is not read by algo.name={algo_name} (the response store's key: "
            "algo.name=ingroup_replay or rescue_replay); remove it or choose a variant that reads it"
            for key in RESPONSE_STORE_KEYS if getattr(x, key) != getattr(default, key) and key not in read]


# algo.* keys the trainer reads whatever the variant (the others are the variant's: it declares which it reads)
TRAINER_ALGO_KEYS = frozenset({"name", "old_logprobs", "skip_grad_bound", "max_consecutive_skips"})


def _set_keys(algo: AlgoConfig) -> dict[str, Any]:
    """The algo.* keys whose value is not the schema's default (set by the preset or the command line); not
    `algo.settings`, whose keys are checked one by one against the variant's settings (algo/settings.py)."""
    default = AlgoConfig()
    return {f.name: getattr(algo, f.name) for f in fields(AlgoConfig)
            if f.name != "settings" and getattr(algo, f.name) != getattr(default, f.name)}


def algo_key_errors(algo: AlgoConfig, read: frozenset[str], fixed: Mapping[str, tuple[Any, str]],
                    unused: Mapping[str, str]) -> list[str]:
    """A key set for a variant that does not read it: every algo.* key away from its default that the variant
    (`algo.name`) neither reads (`read`), fixes (`fixed`: key -> (value, why)) nor leaves unused on purpose
    (`unused`: key -> why; `algo_key_notes` warns of those) -- the variants declare these (algo/group_relative.py)."""
    known = read | TRAINER_ALGO_KEYS | set(fixed) | set(unused)
    return [f"algo.{key}: {value!r} is not read by algo.name={algo.name} (it reads "
            f"{', '.join(sorted(read))}); remove the key or choose a variant that reads it"
            for key, value in _set_keys(algo).items() if key not in known]


def algo_key_notes(algo: AlgoConfig, fixed: Mapping[str, tuple[Any, str]], unused: Mapping[str, str]) -> list[str]:
    """What the run says at start-up about keys set but overridden or unused by the variant."""
    notes = []
    for key, value in _set_keys(algo).items():
        if key in fixed and value != fixed[key][0]:
            notes.append(f"algo.{key}={value!r} is overridden: algo.name={algo.name} takes {fixed[key][0]!r} "
                         f"({fixed[key][1]})")
        elif key in unused:
            notes.append(f"algo.{key}={value!r} is not used by algo.name={algo.name}: {unused[key]}")
    return notes


def _old_logprobs_errors(cfg: RootConfig) -> list[str]:
    if cfg.rollout.vllm.dtype not in CHOICES["rollout.vllm.dtype"]:
        return []  # domain_errors names rollout.vllm.dtype
    try:
        resolve_old_logprobs_for(cfg)
    except ValueError as err:
        return [str(err)]
    return []


def staleness_errors(cfg: RootConfig) -> list[str]:
    """What a run generating `rollout.max_staleness` steps ahead needs (async_generation/schedule.py)."""
    r, e = cfg.rollout, list[str]()
    if r.max_staleness <= 0:
        return e
    if cfg.algo.fresh_is_cap <= 0:
        e.append(f"algo.fresh_is_cap: {cfg.algo.fresh_is_cap}: rollout.max_staleness={r.max_staleness} trains on "
                 "tokens of older weights; their importance weight pi_old / pi_behaviour needs a cap > 0 (e.g. 2)")
    cores = os.cpu_count() or 1  # the launcher may have pinned the trainer (taskset): the generator pins itself
    if any(not 0 <= core < cores for core in r.generator.cpu_cores):
        e.append(f"rollout.generator.cpu_cores: {list(r.generator.cpu_cores)}: this machine has cores 0..{cores - 1}")
    if r.generator.device not in ("auto", "cpu") and not r.generator.device.startswith("cuda"):
        e.append(f"rollout.generator.device: {r.generator.device!r}: expected auto, cpu or cuda[:N]")
    if cfg.parallel.virtual_pipeline_model_parallel_size is not None:
        e.append("parallel.virtual_pipeline_model_parallel_size: rollout.max_staleness > 0 validates with the "
                 "trainer's megatron engine, which takes one model chunk per stage")
    return e


def lora_errors(cfg: RootConfig, te_available: bool | None = None) -> list[str]:
    """LoRA's targets, and what it does not support yet (model/lora.py, docs/lora.md). `te_available`: whether
    Transformer Engine runs here, which `model.layer_spec=auto` resolves by (None: ask this machine)."""
    lo, e = cfg.lora, list[str]()
    unknown = [t for t in lo.targets if t not in LORA_TARGETS]
    if unknown or len(set(lo.targets)) != len(lo.targets):
        e.append(f"lora.targets: {list(lo.targets)}: expected distinct names from {list(LORA_TARGETS)}")
    if lo.rank <= 0:
        if lo.init_from:
            e.append(f"lora.init_from: {lo.init_from!r} with lora.rank=0: a run without adapters cannot start from one")
        return e
    if not lo.targets:
        e.append(f"lora.targets: empty with lora.rank={lo.rank}: name the linears to adapt, e.g. {list(LORA_TARGETS)}")
    if resolve_layer_spec(cfg.model, te_available) == "te":
        chosen = "te" if cfg.model.layer_spec == "te" else "auto, resolved to te here (Transformer Engine and CUDA),"
        e.append(f"model.layer_spec: {chosen} with lora.rank > 0: the adapters wrap the local spec's linears; set "
                 "model.layer_spec=local")
    if cfg.parallel.sequence_parallel:
        e.append("parallel.sequence_parallel: not supported with lora.rank > 0 yet (set it false)")
    if lo.experts and cfg.model.num_experts > 0 and cfg.parallel.expert_tensor_parallel_size > 1:
        e.append("lora.experts: true needs parallel.expert_tensor_parallel_size=1 (sharded experts' adapters are not "
                 "supported yet)")
    return e


def vllm_config_errors(cfg: RootConfig) -> list[str]:
    """`rollout.vllm.*` and what vLLM needs from the rest of the config (only when rollout.engine=vllm)."""
    v, e = cfg.rollout.vllm, []
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if v.max_model_len is not None and v.max_model_len < seq_len:
        e.append(f"rollout.vllm.max_model_len: {v.max_model_len} is shorter than data.max_prompt_length + "
                 f"data.max_response_length = {seq_len}")
    if cfg.rollout.engine == "vllm" and not cfg.model.hf_path:
        e.append("model.hf_path: rollout.engine=vllm needs the model's HF directory (config.json + tokenizer): "
                 "vLLM builds its model from it (export one with tools/convert_megatron_to_hf.py)")
    return e


def decode_loop_errors(cfg: RootConfig) -> list[str]:
    """The megatron engine's continuous loop (rollout/decode_loop.py): its switches, and the layouts it runs."""
    import torch

    r, p, e = cfg.rollout, cfg.parallel, list[str]()
    graphs = str(r.cuda_graphs).lower()
    if graphs not in ("auto", "true", "false"):
        e.append(f"rollout.cuda_graphs: {r.cuda_graphs!r} is not one of auto, true, false")
    elif graphs == "true" and not torch.cuda.is_available():
        e.append("rollout.cuda_graphs: true needs CUDA (auto: on with CUDA, off on CPU)")
    if r.decode_loop == "continuous":
        layout = {"parallel.tensor_model_parallel_size": p.tensor_model_parallel_size,
                  "parallel.pipeline_model_parallel_size": p.pipeline_model_parallel_size}
        e.extend(f"rollout.decode_loop: continuous runs at {k}=1 only, got {v}" for k, v in layout.items() if v > 1)
        if cfg.model.num_experts > 0:
            e.append("rollout.decode_loop: continuous does not run mixture-of-experts models (their token dispatch "
                     "has data-dependent shapes); use chunked or auto")
    return e


def _key(error: str) -> str:
    return error.split(":", 1)[0]


def all_errors(cfg: RootConfig, world_size: int, check_paths: bool = True) -> list[str]:
    """Domain errors, then relation errors for keys whose values are in their domains, then path errors."""
    domains = domain_errors(cfg)
    out_of_domain = {_key(e) for e in domains}
    relations = [e for e in config_errors(cfg, world_size) if _key(e) not in out_of_domain]
    return domains + relations + (path_errors(cfg) if check_paths else [])


def validate(cfg: RootConfig, world_size: int, check_paths: bool = True) -> None:
    """Raise ConfigError listing every problem. `check_paths=False` skips the existence checks of the paths
    the run reads (for checking a preset's values on a machine without its models and data)."""
    errors = all_errors(cfg, world_size, check_paths)
    if errors:
        raise ConfigError(errors)
