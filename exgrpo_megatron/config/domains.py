"""The domain of every numeric config key, and every path a run reads, as declarative tables.

`DOMAINS` lists each int/float field of config/schema.py with its allowed range: finiteness (no NaN; no
±inf unless `inf_ok`), bounds (open or closed), `none_ok` for Optional fields, and `extra` values allowed
outside the range (rollout.top_k = -1: no top-k). `ORDERINGS` relates two keys (optim.min_lr <= optim.lr).
Every string key with a fixed set of values must be one of schema.CHOICES. `path_errors` checks the paths
the run will read. All of it runs in validate.all_errors, before any process group or model exists, and in
the dry run; each error starts with `key: value`. A test checks that every numeric field of the schema has a
row here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

from exgrpo_megatron.config.paths import is_sealed, run_dir_problem
from exgrpo_megatron.config.schema import CHOICES, RESUME_REFUSED, RootConfig

INF = math.inf


@dataclass(frozen=True)
class Domain:
    lo: float = -INF
    hi: float = INF
    lo_open: bool = False  # lo < value instead of lo <= value
    hi_open: bool = False
    none_ok: bool = False
    inf_ok: bool = False  # +inf is a meaningful value (e.g. "no bound")
    extra: tuple[float, ...] = ()  # values allowed outside [lo, hi]

    def describe(self) -> str:
        left = f"{'(' if self.lo_open else '['}{self.lo:g}"
        right = f"{self.hi:g}{')' if self.hi_open or self.hi == INF else ']'}"
        text = f"in {left}, {right}"
        if self.extra:
            text += " or " + " or ".join(f"{v:g}" for v in self.extra)
        return text

    def problem(self, value: object) -> str | None:
        """Why `value` is outside the domain, or None."""
        if value is None:
            return None if self.none_ok else "must be set"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {type(value).__name__}"
        if math.isnan(value):
            return "must be a number, not NaN"
        if math.isinf(value) and not (self.inf_ok and value > 0):
            return "must be finite"
        if value in self.extra:
            return None
        below = value <= self.lo if self.lo_open else value < self.lo
        above = value >= self.hi if self.hi_open else value > self.hi
        return f"must be {self.describe()}" if below or above else None


POSITIVE = Domain(lo=0, lo_open=True)
NON_NEGATIVE = Domain(lo=0)
AT_LEAST_1 = Domain(lo=1)
UNIT_OPEN = Domain(lo=0, hi=1, lo_open=True, hi_open=True)  # (0, 1)
PROBABILITY_MASS = Domain(lo=0, hi=1, lo_open=True)  # (0, 1]
ANY_FINITE = Domain()

DOMAINS: dict[str, Domain] = {
    "seed": Domain(lo=0, hi=2**32 - 1),  # numpy seeds
    # model
    "model.num_layers": AT_LEAST_1, "model.hidden_size": AT_LEAST_1, "model.ffn_hidden_size": AT_LEAST_1,
    "model.num_attention_heads": AT_LEAST_1, "model.num_query_groups": AT_LEAST_1,
    "model.kv_channels": Domain(lo=1, none_ok=True), "model.vocab_size": AT_LEAST_1,
    "model.make_vocab_size_divisible_by": AT_LEAST_1, "model.max_position_embeddings": AT_LEAST_1,
    "model.rope_theta": POSITIVE, "model.rope_scaling_factor": Domain(lo=0, lo_open=True, none_ok=True),
    "model.rms_norm_eps": POSITIVE, "model.init_method_std": POSITIVE,
    "model.num_experts": NON_NEGATIVE, "model.moe_ffn_hidden_size": Domain(lo=1, none_ok=True),
    "model.moe_router_topk": AT_LEAST_1, "model.moe_aux_loss_coeff": NON_NEGATIVE,
    "model.moe_z_loss_coeff": NON_NEGATIVE,
    # parallel
    "parallel.tensor_model_parallel_size": AT_LEAST_1, "parallel.pipeline_model_parallel_size": AT_LEAST_1,
    "parallel.virtual_pipeline_model_parallel_size": Domain(lo=1, none_ok=True),
    "parallel.context_parallel_size": AT_LEAST_1,
    "parallel.expert_model_parallel_size": AT_LEAST_1, "parallel.expert_tensor_parallel_size": AT_LEAST_1,
    "parallel.collective_timeout_s": AT_LEAST_1,  # seconds one collective may wait (collective_watch.py)
    # optim
    "optim.lr": NON_NEGATIVE, "optim.min_lr": NON_NEGATIVE, "optim.lr_warmup_steps": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE, "optim.adam_beta1": Domain(lo=0, hi=1, hi_open=True),
    "optim.adam_beta2": Domain(lo=0, hi=1, hi_open=True), "optim.adam_eps": POSITIVE,
    "optim.clip_grad": NON_NEGATIVE,  # 0 = no clipping
    # rollout
    "rollout.n": Domain(lo=2), "rollout.temperature": POSITIVE, "rollout.top_p": PROBABILITY_MASS,
    "rollout.top_k": Domain(lo=1, extra=(-1,)), "rollout.max_batch_sequences": AT_LEAST_1,
    "rollout.stop_check_every": AT_LEAST_1,
    "rollout.vllm.gpu_memory_utilization": UNIT_OPEN, "rollout.vllm.refit_bucket_mb": AT_LEAST_1,
    "rollout.vllm.max_model_len": Domain(lo=1, none_ok=True), "rollout.vllm.sleep_level": Domain(lo=1, hi=2),
    "rollout.val_temperature": NON_NEGATIVE,  # 0 = greedy
    "rollout.val_top_p": PROBABILITY_MASS,
    "rollout.max_staleness": NON_NEGATIVE,  # 0 = colocated, generate then train
    "rollout.generator.threads": NON_NEGATIVE,  # 0 = torch's default
    "rollout.generator.startup_timeout_seconds": POSITIVE, "rollout.generator.deadline_factor": POSITIVE,
    "rollout.generator.deadline_min_seconds": POSITIVE,  # the generator's deadline (async_generation/watch.py)
    # algo
    "algo.clip_ratio": POSITIVE, "algo.clip_ratio_high": Domain(lo=0, lo_open=True, none_ok=True),
    "algo.entropy_coeff": NON_NEGATIVE,
    "algo.skip_grad_bound": Domain(lo=0, lo_open=True, inf_ok=True),  # inf = never skip
    "algo.max_consecutive_skips": AT_LEAST_1, "algo.loss_seqs_per_rank_ref": POSITIVE,
    "algo.entropy_microbatches_ref": POSITIVE,
    "algo.max_refill_rounds": NON_NEGATIVE,  # 0 = a dropped group is not replaced
    "algo.fresh_is_cap": NON_NEGATIVE,  # 0 = no truncated IS on fresh tokens
    # trainer
    "trainer.total_steps": AT_LEAST_1, "trainer.train_batch_size": AT_LEAST_1,
    "trainer.ppo_mini_batch_size": AT_LEAST_1, "trainer.micro_batch_max_tokens": AT_LEAST_1,
    "trainer.update_epochs": AT_LEAST_1,
    "trainer.train_threads": NON_NEGATIVE,  # 0 = this rank's share of the node's cores
    "trainer.val_every": NON_NEGATIVE,  # 0 = never
    "trainer.val_n": AT_LEAST_1, "trainer.sft_warm_start_steps": NON_NEGATIVE,
    "trainer.sft_warm_start_lr": POSITIVE,
    "trainer.sft_warm_start_examples": NON_NEGATIVE,  # 0 = data.num_train_examples
    # experience
    "experience.ratio": Domain(lo=0, hi=1, hi_open=True),
    "experience.delayed_start_pass_rate": Domain(hi=1),  # <= 0: mixed mode from step 1
    "experience.admit_correct_above": NON_NEGATIVE, "experience.admit_correct_at_most": NON_NEGATIVE,
    "experience.retire_correct_above": Domain(lo=0, none_ok=True),  # None = K - 1
    "experience.max_age_steps": NON_NEGATIVE,  # 0 = no age bound
    "experience.bucket_mu": ANY_FINITE, "experience.bucket_sigma": POSITIVE,
    "experience.max_trajectories_per_question": NON_NEGATIVE,  # 0 = no cap
    "experience.ingroup_size": AT_LEAST_1,  # r stored responses per fresh group at most
    # data
    "data.max_prompt_length": AT_LEAST_1, "data.max_response_length": AT_LEAST_1,
    "data.num_val_examples": AT_LEAST_1, "data.num_train_examples": AT_LEAST_1,
    "data.num_test_examples": NON_NEGATIVE,  # 0 = no test split
    "data.max_unparsable_answers": Domain(lo=0, hi=1),  # a fraction of the rows (reward/answer_check.py)
    # reward
    "reward.timeout_seconds": AT_LEAST_1, "reward.hard_deadline_seconds": POSITIVE,
    "reward.num_workers": AT_LEAST_1,
    # checkpoint
    "checkpoint.save_every": AT_LEAST_1, "checkpoint.keep_last": AT_LEAST_1,
    # lora
    "lora.rank": NON_NEGATIVE,  # 0 = off
    "lora.alpha": POSITIVE, "lora.dropout": Domain(lo=0, hi=1, hi_open=True),
}

# (smaller key, larger key): value(smaller) <= value(larger)
ORDERINGS: tuple[tuple[str, str], ...] = (
    ("optim.min_lr", "optim.lr"),
    ("trainer.ppo_mini_batch_size", "trainer.train_batch_size"),
)


def value_of(cfg: RootConfig, key: str) -> object:
    return attrgetter(key)(cfg)


def domain_errors(cfg: RootConfig) -> list[str]:
    errors = []
    for key, domain in DOMAINS.items():
        value = value_of(cfg, key)
        reason = domain.problem(value)
        if reason is not None:
            errors.append(f"{key}: {value!r}: {reason}")
    for key, allowed in CHOICES.items():
        value = value_of(cfg, key)
        if value not in allowed:
            errors.append(f"{key}: {value!r} is not one of {list(allowed)}")
    for key in cfg.checkpoint.allow_config_change:
        if key not in RESUME_REFUSED:
            errors.append(f"checkpoint.allow_config_change: {key!r} is not a key a resume refuses to change "
                          f"(those are {sorted(RESUME_REFUSED)}; the others change freely)")
    bad = {e.split(":", 1)[0] for e in errors}
    for small, large in ORDERINGS:
        a, b = value_of(cfg, small), value_of(cfg, large)
        if small in bad or large in bad or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            continue
        if a > b:
            errors.append(f"{small}: {a!r}: must be <= {large} ({b!r})")
    return errors


# ----------------------------------------------------------------------------------------- paths
def _is_resume_path(value: str) -> bool:
    return value.strip().lower() not in ("auto", "none", "", "null", "false")


def _path_problem(value: str, kind: str) -> str | None:
    path = Path(value).expanduser()
    if not path.exists():
        return "does not exist"
    if kind == "file" and not path.is_file():
        return "is not a file"
    if kind == "dir" and not path.is_dir():
        return "is not a directory"
    if not os.access(path, os.R_OK):
        return "is not readable"
    return None


def path_errors(cfg: RootConfig) -> list[str]:
    """Every path the run will read: `key: value: reason`."""
    d, m, ck = cfg.data, cfg.model, cfg.checkpoint
    wanted: list[tuple[str, str, str]] = []  # (key, value, kind)
    if d.source == "files":
        wanted += [(f"data.train_files[{i}]", p, "file") for i, p in enumerate(d.train_files)]
        wanted += [(f"data.val_files[{i}]", p, "file") for i, p in enumerate(d.val_files)]
    if m.hf_path:
        wanted.append(("model.hf_path", m.hf_path, "dir"))
    if ck.init_from:
        wanted.append(("checkpoint.init_from", ck.init_from, "dir"))
    if cfg.lora.init_from:
        wanted.append(("lora.init_from", cfg.lora.init_from, "dir"))
    if _is_resume_path(ck.resume):
        wanted.append(("checkpoint.resume", ck.resume, "dir"))
    if cfg.experience.pool_file_in:
        wanted.append(("experience.pool_file_in", cfg.experience.pool_file_in, "file"))
    errors = []
    for key, value, kind in wanted:
        reason = _path_problem(value, kind)
        if reason is not None:
            errors.append(f"{key}: {value!r}: {reason}")
    if ck.init_from and not errors_for(errors, "checkpoint.init_from"):
        if not is_sealed(ck.init_from):
            errors.append(f"checkpoint.init_from: {ck.init_from!r}: has no manifest.json (size + sha256 of its "
                          "files), so it cannot be verified; re-export it with tools/convert_hf_to_megatron.py")
        for needed in ("model", "model_config.yaml"):
            if not (Path(ck.init_from).expanduser() / needed).exists():
                errors.append(f"checkpoint.init_from: {ck.init_from!r}: has no {needed} (not a megatron "
                              "checkpoint from tools/convert_hf_to_megatron.py)")
    run_dir = run_dir_problem(cfg.logging.run_dir)
    return errors + ([run_dir] if run_dir is not None else [])


def errors_for(errors: list[str], key: str) -> list[str]:
    return [e for e in errors if e.split(":", 1)[0] == key]
