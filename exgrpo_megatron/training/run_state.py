"""Everything around the step: resume, checkpoint, metrics/progress, validation, preemption.

State that a checkpoint must carry to continue *exactly*: step, the experience schedule's phase, the prompt
sampler's epoch/position, consecutive skipped updates, the pool shards (or the response store's), model +
optimizer + LR schedule, every RNG (checkpoint/ saves the last two groups) and, generating ahead, the plans
and rollouts in flight.
Checkpoints from before the schedule (a delayed-start "switch" and "collected_once") resume through
`experience.schedule.legacy_state`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from exgrpo_megatron.checkpoint import (
    LoadedCheckpoint,
    check_room_for_checkpoint,
    model_config_to_yaml,
    save_checkpoint,
)
from exgrpo_megatron.checkpoint.lora_base import base_record
from exgrpo_megatron.checkpoint.model_state import ensure_signal_proof_save_workers
from exgrpo_megatron.checkpoint.pool_file import PoolFileError, export_store, import_store
from exgrpo_megatron.config.loader import to_yaml
from exgrpo_megatron.config.resume_changes import check_resume_config
from exgrpo_megatron.config.validate import ConfigError
from exgrpo_megatron.data.token_cache import tokenizer_fingerprint
from exgrpo_megatron.distributed.preemption import REQUEUE_EXIT_CODE, PreemptionHandler
from exgrpo_megatron.experience.schedule import legacy_state
from exgrpo_megatron.logging import MetricsLogger, ProgressBar, save_resolved_config
from exgrpo_megatron.policy.warm_start import warm_start_weights
from exgrpo_megatron.training.async_generation.schedule import AheadGeneration
from exgrpo_megatron.training.components import Components
from exgrpo_megatron.training.heldout_accuracy import validate_accuracy


class Stateful(Protocol):
    """A part whose state a checkpoint's trainer state carries under the part's name."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RunState:
    c: Components
    step: int = 0
    consecutive_skips: int = 0
    logger: MetricsLogger | None = None
    progress: ProgressBar | None = None
    preemption: PreemptionHandler | None = None
    requeue_exit_code: int = REQUEUE_EXIT_CODE
    last_saved: int = field(default=-1)
    ahead: AheadGeneration | None = None  # rollout.max_staleness > 0: the generator process and the plans in flight
    generated: dict[str, float] = field(default_factory=lambda: {"trajectories": 0.0, "tokens": 0.0})  # cumulative
    lora_base: dict | None = None  # LoRA on a sealed dir's base weights: checkpoints name it (checkpoint/lora_base.py)

    @classmethod
    def start(cls, c: Components, preemption: PreemptionHandler) -> RunState:
        """Resume (newest verified checkpoint) or initialise. `preemption`: the handler installed at process
        start (start-up mode: a signal aborts start-up); switched here to the step-boundary mode. Generating
        ahead, the generator process starts first (it builds its model while the checkpoint loads)."""
        cfg = c.cfg
        state = cls(c)
        if cfg.rollout.max_staleness > 0:
            from megatron.core import parallel_state as ps

            replica0 = c.layout.dp_rank == 0 and ps.get_context_parallel_rank() == 0
            state.ahead = AheadGeneration(cfg, c.layout.rank, gathers_weights=replica0, modules=c.policy.modules)
        try:
            # before any slow start-up work (the warm start): the newest checkpoint's size covers a resumed pool
            check_room_for_checkpoint(cfg.logging.run_dir, c.policy.modules, state.pool_shard())
            resumed = state.resume_or_initialise()
        except BaseException:
            state.close_generator()
            raise
        main = c.layout.rank == 0
        if main:
            save_resolved_config(cfg.logging.run_dir, to_yaml(cfg))
        state.logger = MetricsLogger(cfg.logging.run_dir, tensorboard=cfg.logging.tensorboard,
                                     wandb_project=cfg.logging.wandb_project, enabled=main,
                                     resume_step=state.step if resumed else None)
        state.progress = ProgressBar(cfg.trainer.total_steps, start_step=state.step,
                                     enabled=main and cfg.logging.progress_bar)
        # the checkpoint writers' results Manager starts now, while a signal still aborts start-up: a new process takes
        # seconds to ignore the preemption signals, and one started by the first save dies of a signal sent to the
        # process group then, and the save with it
        ensure_signal_proof_save_workers()
        state.preemption = preemption.finish_startup()
        if state.ahead is not None:
            state.ahead.watch_preemption(preemption)
        return state

    def resume_or_initialise(self) -> bool:
        """The newest verified checkpoint (True), else the initial weights (init_from or the SFT warm start)."""
        c, cfg = self.c, self.c.cfg
        resume = c.policy.resume(cfg.logging.run_dir, cfg.checkpoint.resume)
        if resume is not None:
            changes = check_resume_config(resume.config_yaml, cfg, str(resume.path))  # ConfigError: refused keys
            if c.layout.rank == 0:
                for line in changes:
                    print(f"exgrpo-train: resume: {line}", file=sys.stderr)
            self.load(resume)
            self.lora_base = resume.lora_base
            return True
        self.import_store_file()  # before the slow weight loading: a refused pool file stops the run early
        if cfg.checkpoint.init_from or cfg.trainer.sft_warm_start_steps > 0:
            base = cfg.checkpoint.init_from or warm_start_weights(cfg, c.tokenizer)
            c.policy.load_weights(base)
            self.lora_base = base_record(base) if cfg.lora.rank > 0 else None
        if cfg.lora.init_from:  # adapters trained elsewhere (PEFT's format) on the base just loaded
            from exgrpo_megatron.convert.peft_adapter import megatron_adapters_from_peft

            c.policy.load_adapters(megatron_adapters_from_peft(cfg.lora.init_from, cfg.model, cfg.lora))
        return False

    # ------------------------------------------------------------------ checkpoint
    def stateful_parts(self) -> dict[str, Stateful]:
        """The parts saved in the trainer state, by name: the experience schedule, the prompt sampler and,
        generating ahead, the plans and rollouts in flight (async_generation/). The model, optimizer, LR schedule
        and RNGs go through checkpoint/, the pool's shards beside them (`save`)."""
        parts: dict[str, Stateful] = {"schedule": self.c.schedule, "sampler": self.c.sampler}
        if self.ahead is not None:
            parts["ahead"] = self.ahead
        return parts

    def trainer_state(self) -> dict:
        return {"step": self.step, "consecutive_skips": self.consecutive_skips, "generated": dict(self.generated),
                **{name: part.state_dict() for name, part in self.stateful_parts().items()}}

    def pool_shard(self) -> tuple[dict, dict] | None:
        """This DP replica's pool -- the experience pool, or the response store (a variant has one or neither) --
        as a checkpoint holds it (arrays, meta); None without either."""
        store = self.c.pool if self.c.pool is not None else self.c.responses
        pool = store.state_dict() if store is not None else None
        return (pool["arrays"], pool["meta"]) if pool is not None else None

    def store_file_identity(self) -> dict[str, Any]:
        """What a pool file records of this run and checks on reading (checkpoint/pool_file.py)."""
        c = self.c
        return {"vocab_size": c.cfg.model.vocab_size, "tokenizer": tokenizer_fingerprint(c.tokenizer),
                "prompt_ids": lambda qid: c.train_data[qid].prompt_ids}

    def import_store_file(self) -> None:
        """A new run's initial response store from `experience.pool_file_in` (ConfigError naming it: exit 2)."""
        path = self.c.cfg.experience.pool_file_in
        if self.c.responses is None or not path:
            return
        try:
            import_store(self.c.responses, path, **self.store_file_identity())
        except PoolFileError as exc:
            raise ConfigError([f"experience.pool_file_in: {exc}"]) from None
        if self.c.layout.rank == 0:
            print(f"exgrpo-train: response store from {path}", file=sys.stderr)

    def save(self, step: int) -> None:
        if step == self.last_saved:
            return
        c = self.c
        path = save_checkpoint(
            c.cfg.logging.run_dir, step, model_chunks=c.policy.modules, optimizer=c.policy.optimizer,
            opt_param_scheduler=c.policy.scheduler, pool_shard=self.pool_shard(),
            pool_shard_index=(c.layout.dp_rank, c.layout.dp_size), trainer_state=self.trainer_state(),
            config_yaml=to_yaml(c.cfg), model_config_yaml=model_config_to_yaml(c.cfg.model),
            keep_last=c.cfg.checkpoint.keep_last, lora_base=self.lora_base)
        self.last_saved = step
        if c.responses is not None and c.cfg.experience.pool_file_out:
            export_store(c.responses, c.cfg.experience.pool_file_out, is_writer=c.layout.rank == 0, step=step,
                         **self.store_file_identity())
        if c.layout.rank == 0:
            message = f"exgrpo-train: saved checkpoint {path}"
            if self.progress is not None:
                self.progress.write(message)  # on its own line, not glued to the progress line
            else:
                print(message, file=sys.stderr)

    def load(self, loaded: LoadedCheckpoint) -> None:
        """Take the trainer state and pool shards of a loaded (model, optimizer, RNG: already) checkpoint."""
        c = self.c
        ts = loaded.trainer_state
        self.step = self.last_saved = int(ts["step"])
        self.consecutive_skips = int(ts["consecutive_skips"])
        if "generated" in ts:
            self.generated = {k: float(v) for k, v in ts["generated"].items()}
        elif c.layout.rank == 0:  # a checkpoint from before the counts
            print("exgrpo-train: resume: the checkpoint has no generation counts; generation/*_total count from "
                  "this resume", file=sys.stderr)
        if "schedule" not in ts:  # a checkpoint from before the schedule
            ts = {**ts, "schedule": legacy_state(ts["switch"], bool(ts["collected_once"]))}
        for name, part in self.stateful_parts().items():
            part.load_state_dict(ts[name])
        states = [{"arrays": arrays, "meta": meta} for arrays, meta in loaded.pool_shards]
        if c.pool is not None and states:
            c.pool.load_state_dicts(states)
        if c.responses is not None and states:
            c.responses.load_state_dicts(states)
        if c.layout.rank == 0:
            print(f"exgrpo-train: resumed from {loaded.path} at step {self.step}", file=sys.stderr)

    # ------------------------------------------------------------------ per step
    def finish_step(self, step: int, metrics: dict[str, float | str]) -> None:
        assert self.logger is not None and self.progress is not None, "RunState.start sets them"
        self.step = step
        metrics["optim/consecutive_skips"] = float(self.consecutive_skips)
        for key in ("trajectories", "tokens"):  # cumulative generation (the step's: generation/<key>)
            self.generated[key] += float(metrics.get(f"generation/{key}", 0.0))
            metrics[f"generation/{key}_total"] = self.generated[key]
        self.logger.log(step, metrics)
        self.progress.update(step, metrics)

    def validate(self, step: int) -> dict[str, float]:
        c = self.c
        if c.val_data is None:
            return {}
        return validate_accuracy(c, c.val_data, step)

    def preempted(self) -> bool:
        assert self.preemption is not None, "RunState.start sets it"
        return self.preemption.should_stop()

    def stop_for_preemption(self, step: int, why: str = "") -> int:
        """After `preempted()` said so (or the wait for the generator was given up on, `why`): save `step` (none
        before the first), say why the run stops (rank 0), return the requeue exit code."""
        assert self.preemption is not None, "RunState.start sets it"
        if step > 0:
            self.save(step)  # generating ahead: gives up on a stopped or late generator (async_generation/schedule.py)
        if self.c.layout.rank == 0:
            why = why or (self.ahead.failure if self.ahead is not None and self.ahead.failure else "")
            print(self.preemption.stop_message(step, why), file=sys.stderr, flush=True)
        return self.requeue_exit_code

    def report_done(self) -> None:
        if self.c.layout.rank == 0:
            run_dir = self.c.cfg.logging.run_dir
            print(f"exgrpo-train: done. metrics: {run_dir}/metrics.jsonl  checkpoints: {run_dir}/checkpoints  "
                  f"plot: python tools/plot_run.py {run_dir}", file=sys.stderr)

    def close_generator(self) -> None:
        if self.ahead is not None:
            self.ahead.close()

    def close(self) -> None:
        self.close_generator()
        for closer in (self.progress, self.logger):
            if closer is not None:
                closer.close()
        if self.preemption is not None:
            self.preemption.uninstall()
        torch.distributed.barrier()
