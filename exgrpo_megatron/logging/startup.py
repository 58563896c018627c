"""The start-up block rank 0 prints once: what kind of run this is, where it writes, how it is laid out."""

from __future__ import annotations

from exgrpo_megatron.algo.protocol import RLAlgorithm
from exgrpo_megatron.algo.registry import algorithm_notes, settings_in_effect
from exgrpo_megatron.config.derived import resolve_layer_spec, resolve_params_dtype
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.distributed.cpu_warnings import cpu_run_banner
from exgrpo_megatron.distributed.runtime import ParallelLayout
from exgrpo_megatron.experience.response_store import ResponseReplay
from exgrpo_megatron.machine.cpu_precision import cpu_precision_line, this_cpu_bf16_unit
from exgrpo_megatron.planning.dry_run import generation_line

PREFIX = "exgrpo-train: "


def startup_block(cfg: RootConfig, layout: ParallelLayout, algorithm: RLAlgorithm) -> str:
    """A few lines: the CPU banner and precision (CPU only), run dir, parallel layout, steps and validation, the
    algorithm with its own settings in effect (algo/settings.py) and what it replays, where the rollouts come from
    (in the step, or generated ahead), LoRA when on."""
    lines = []
    if layout.device.type == "cpu":
        m = cfg.model
        bf16 = str(resolve_params_dtype(m)) == "torch.bfloat16"
        lines += [cpu_run_banner(resolve_layer_spec(m)),
                  cpu_precision_line(m.params_dtype, this_cpu_bf16_unit(), m.hidden_size, bf16)]
    t = cfg.trainer
    lines.append(f"run dir {cfg.logging.run_dir}; layout TP={layout.tp_size} PP={layout.pp_size} "
                 f"DP={layout.dp_size} EP={layout.ep_size} ETP={cfg.parallel.expert_tensor_parallel_size} "
                 f"(world {layout.world_size}, {layout.device.type})")
    val = f"validation avg@{t.val_n} every {t.val_every} steps" if t.val_every else "no validation"
    lines.append(f"{t.total_steps} steps of {t.train_batch_size} prompts x {cfg.rollout.n} rollouts; {val}")
    replay = replay_summary(cfg, algorithm)
    settings = ", ".join(f"{key}={value!r}" for key, value in settings_in_effect(cfg.algo).items())
    lines += [f"algorithm {cfg.algo.name}{f' (settings: {settings})' if settings else ''}; {replay}",
              *(f"note: {note}" for note in algorithm_notes(cfg.algo)), generation_line(cfg)]
    lo = cfg.lora
    if lo.rank > 0:
        experts = (" (experts too)" if lo.experts else " (not the experts)") if cfg.model.num_experts else ""
        start = f"; a fresh start takes the adapters of {lo.init_from}" if lo.init_from else ""
        lines.append(f"LoRA rank {lo.rank}, alpha {lo.alpha:g} on {', '.join(lo.targets)}{experts}: the base weights "
                     f"are frozen, only the adapters train{start}")
    return "\n".join(PREFIX + line for line in lines)


def replay_summary(cfg: RootConfig, algorithm: RLAlgorithm) -> str:
    """What the algorithm replays, in one line (this block and the dry run): its experience pool's rule, the stored
    responses a fresh group gains, or nothing (on-policy)."""
    rule = algorithm.response_replay(cfg.experience)
    return pool_replay_line(cfg, algorithm.uses_pool) if rule is None else response_replay_line(cfg, rule)


def response_replay_line(cfg: RootConfig, rule: ResponseReplay) -> str:
    """What in-group / rescue replay adds to a fresh group (experience/response_store.py)."""
    x = cfg.experience
    gains = ("a fresh group whose responses all fail gains its question's newest stored success" if rule.rescue_only
             else f"each fresh group gains up to {rule.per_question} of its question's newest stored responses "
             f"({'successes and failures' if rule.failures else 'successes only'})")
    age = f"; stored responses replayed up to {x.max_age_steps} steps old" if x.max_age_steps else ""
    start = f"; initial store from {x.pool_file_in}" if x.pool_file_in else ""
    return f"response replay: {gains}, none generated{age}{start}"


def pool_replay_line(cfg: RootConfig, replays: bool) -> str:
    """What an algorithm with an experience pool (`replays`) replays from it; without one, that it is on-policy."""
    t, x, k = cfg.trainer, cfg.experience, cfg.rollout.n
    if not replays:
        return f"experience replay: off (on-policy {cfg.algo.name})"
    n_exp = int(t.train_batch_size * x.ratio)
    start = (f"once batch pass rate > {x.delayed_start_pass_rate}" if x.delayed_start_pass_rate > 0
             else "from step 1 (delayed start disabled)")
    fresh = t.train_batch_size - n_exp if x.placement == "displace" else t.train_batch_size
    return (f"experience replay ({x.placement}): mixed phase {start}: up to {n_exp} replayed + {fresh} fresh prompts "
            f"(rho={x.ratio}; enter iff {x.admit_correct_above} < correct <= {x.admit_correct_at_most} of {k}, retire "
            f"above {x.retire_above(k)}" + (f", trajectories replayed up to {x.max_age_steps} steps old)"
                                            if x.max_age_steps else ")"))
