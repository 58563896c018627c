"""The training loop: one function per step, one function per verb of the step.

    plan + draw (fresh prompts; replays chosen by the pool's scorer) -> generate (replays spliced; grading
    streams alongside) -> grade -> assemble the batch (advantages, pi_old) -> update -> collect into the pool
    (the schedule moves on) -> log

Every rank runs this loop (SPMD). The step plan is identical on all ranks; each DP rank works on
its share of the groups, and every TP/PP rank of a replica sees identical data. The phase (warm-up ->
collecting -> mixed) is `c.schedule`'s; the algorithm (`c.algorithm`, `algo.name`) owns the loss. Observers
(`run_training(cfg, observers=[...])`, step_observer.py) receive what each verb produced.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

import numpy as np

from exgrpo_megatron.algo.loss import global_loss_counts
from exgrpo_megatron.algo.protocol import GradedResponse, RLAlgorithm
from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.data.step_plan import QuestionGroup, compose_step, local_groups
from exgrpo_megatron.distributed import collective_watch
from exgrpo_megatron.distributed.preemption import PreemptionHandler
from exgrpo_megatron.distributed.runtime import init_distributed
from exgrpo_megatron.experience.schedule import Phase, solved_fraction
from exgrpo_megatron.experience.types import GroupOutcome
from exgrpo_megatron.logging.startup import startup_block
from exgrpo_megatron.policy.objective import rl_loss_fn
from exgrpo_megatron.policy.old_logprobs import old_logprobs, replay_current_logprobs
from exgrpo_megatron.policy.replay_scores import make_scorer
from exgrpo_megatron.policy.train_batch import (
    RolloutRows,
    TrainBatch,
    build_rollout_rows,
    micro_batches_for_update,
)
from exgrpo_megatron.reward.rollout_rewards import rewards_per_group
from exgrpo_megatron.rollout.group_filter import StepRollouts, filter_and_refill
from exgrpo_megatron.rollout.stored_responses import stored_outcomes, with_stored_responses
from exgrpo_megatron.rollout.types import Sample
from exgrpo_megatron.training.async_generation.schedule import AheadGeneration
from exgrpo_megatron.training.async_generation.watch import (
    EXIT_GENERATOR_FAILED,
    GeneratorFailed,
    PreemptedWhileWaiting,
)
from exgrpo_megatron.training.components import Components, build_components
from exgrpo_megatron.training.rollout_service import GeneratedGroups, step_seed
from exgrpo_megatron.training.run_state import RunState
from exgrpo_megatron.training.step_metrics import (
    StepTimer,
    TrainMetrics,
    UpdateMetrics,
    consecutive_skips_after,
    dp_reduce,
    generation_sums,
    local_totals,
    pop_mismatch,
    rollout_mismatch,
    rollout_sums,
    step_summary,
)
from exgrpo_megatron.training.step_observer import StepObserver, StepObservers


def train_step(c: Components, state: RunState, step: int) -> dict[str, float | str]:
    """plan -> generate -> grade -> [filter + refill] -> batch -> pi_old -> update -> pool + schedule -> metrics;
    generating ahead (`state.ahead`): `train_step_ahead`."""
    if state.ahead is not None:
        return train_step_ahead(c, state.ahead, state, step)
    phase = c.schedule.phase
    timer = StepTimer()
    groups = plan_step(c, step, phase)
    c.observers.notify("planned", groups)
    mine = local_groups(groups, c.layout.dp_rank, c.layout.dp_size)
    generated = generate(c, mine, step)
    timer.lap("generate")
    graded = generated.grading.result()  # time/reward: the grading not overlapped with generation
    rollouts = StepRollouts.unfiltered(mine, generated.samples, rewards_per_group(graded.rewards, generated.samples))
    timer.lap("reward")
    if c.algorithm.filters_groups:
        rollouts = refill_dropped_groups(c, rollouts, step)
        timer.lap("refill")
    if c.responses is not None:  # in-group / rescue replay: before this step's responses enter the store
        rollouts = with_stored_responses(c.responses, rollouts)
    trained = train_on(c, state, rollouts, phase, timer)
    collect_into_pool(c, rollouts, step)
    timer.lap("pool")
    out = step_report(c, trained, graded.n_worker_deaths, timer, phase, groups, generated.refit_seconds)
    out["reward/grader_timeouts"] = float(graded.n_timeouts_killed)
    if c.algorithm.filters_groups:
        out.update({"filter/dropped_groups": float(rollouts.dropped), "filter/refill_rounds": float(rollouts.rounds)})
    return out


def train_step_ahead(c: Components, ahead: AheadGeneration, state: RunState, step: int) -> dict[str, float | str]:
    """One step generating ahead (async_generation/): take step t's rollouts -> pool + schedule -> ask for step
    t+s's (composed now, the current weights) -> batch -> pi_old -> update (the generator generates meanwhile)."""
    timer = StepTimer()
    for t in ahead.steps_to_plan(step):  # the run's first steps (all from the initial weights)
        ahead.submit(t, c.schedule.phase.value, plan_step(c, t, c.schedule.phase), weights_step=step - 1)
    planned, result = ahead.take(step)
    timer.lap("generate")  # waiting for the generator
    phase = Phase(planned.phase)
    r, d = c.layout.dp_rank, c.layout.dp_size
    rollouts = StepRollouts.unfiltered(planned.groups[r::d], result.samples[r::d], result.rewards[r::d])
    if c.responses is not None:  # in-group / rescue replay: before this step's responses enter the store
        rollouts = with_stored_responses(c.responses, rollouts)
    collect_into_pool(c, rollouts, step)
    nxt = step + ahead.staleness
    ahead.submit(nxt, c.schedule.phase.value, plan_step(c, nxt, c.schedule.phase), weights_step=step - 1)
    timer.lap("pool")
    trained = train_on(c, state, rollouts, phase, timer)
    out = step_report(c, trained, result.grader_worker_deaths, timer, phase, planned.groups, 0.0)
    out.update({"reward/grader_timeouts": float(result.grader_timeouts),
                "rollout/staleness": float(step - 1 - result.weights_step),
                "time/generator_generate": result.generate_seconds, "time/generator_load_weights": result.load_seconds})
    return out


def train_on(c: Components, state: RunState, rollouts: StepRollouts, phase: Phase, timer: StepTimer) -> TrainMetrics:
    """rows -> pi_old -> the updates (the run's count of consecutive skipped updates moves on); returns what this
    rank measured."""
    c.observers.notify("rolled_out", rollouts)
    rows = build_rollout_rows(rollouts.samples, rollouts.rewards, c.algorithm.advantages)
    c.observers.notify("rows_built", rows)
    batch, forward_rows = with_old_logprobs(c, rows, rollouts.groups)
    c.observers.notify("batch_ready", batch)
    mismatch = recomputed_mismatch(c, batch)
    timer.lap("old_logprobs")
    updates = update_policy(c, batch, len(rollouts.groups), phase)
    state.consecutive_skips = consecutive_skips_after(state.consecutive_skips, [u.result.skipped for u in updates])
    timer.lap("update")
    sums = {**rollout_sums(rows), **generation_sums(rollouts.graded_samples)}
    return TrainMetrics(sums, mismatch, tuple(updates), forward_rows)


def step_report(c: Components, trained: TrainMetrics, grader_deaths: int, timer: StepTimer, phase: Phase,
                groups: list[QuestionGroup], refit_seconds: float) -> dict[str, float | str]:
    """The step's metrics: what the ranks measured, reduced over DP once (step_metrics.py), and the step's own."""
    reduced = dp_reduce(local_totals(trained, grader_deaths, c.algorithm.metric_reduce_op), c.dp_group)
    out: dict[str, float | str] = dict(step_summary(reduced, trained.updates, c.algorithm.step_metrics))
    out.update({
        "phase": "warmup" if phase is Phase.WARMUP else "mixed",
        "experience/n_replayed": float(sum(g.replay is not None for g in groups)),
        "old_logprobs/forward_rows": reduced.sums["forward_rows"],
        "train/padding_share": c.policy.take_padding_share(),  # padding / token slots through the model
        **c.policy.expert_load.take_metrics(c.dp_group),  # MoE: tokens per expert (model/expert_load.py)
        **c.policy.routing.take_metrics(c.dp_group),  # MoE: rollout vs training routing (model/routing_replay.py)
    })
    out.update(step_times(timer, refit_seconds))
    tokens = float(out.pop("tokens/total", 0.0))  # prompt + response tokens of the rows trained on, DP-global
    out["train/tokens"] = tokens * c.settings.update_epochs  # through the updates' forward + backward, every pass
    out["throughput/tokens_per_s"] = tokens / max(timer.total(), 1e-9)
    if c.pool is not None:
        out.update(c.pool.stats())
    if c.responses is not None:
        out.update(c.responses.stats())
    return out


def step_times(timer: StepTimer, refit_seconds: float) -> dict[str, float]:
    """time/*: generate (refit included; generating ahead: the wait for the generator), reward (grading not
    overlapped with generation), refill (filtering algorithms), old_logprobs, train (old_logprobs + the updates),
    pool (generating ahead: the pool, the schedule and the next plan), step."""
    t = timer.seconds
    out = {"time/generate": t["generate"], "time/reward": t.get("reward", 0.0), "time/old_logprobs": t["old_logprobs"],
           "time/train": t["old_logprobs"] + t["update"], "time/step": timer.total(), "time/refit": refit_seconds}
    if "refill" in t:
        out["time/refill"] = t["refill"]
    return out


def plan_step(c: Components, step: int, phase: Phase) -> list[QuestionGroup]:
    """The step's global batch of question groups (identical on every rank): fresh prompts and, in the mixed
    phase, replayed questions whose trajectory the pool chose with the current policy's scores (the selection
    pass keeps the replays' pi_old at the loss temperature when pi_old comes from the rollout)."""
    s = c.settings
    reuse = c.old_logprobs == "rollout"
    scorer = make_scorer(c.policy, s.micro_batch_max_tokens, c.train_data,
                         logprob_temperature=s.sampling.temperature if reuse else None)
    x = c.pool.settings if c.pool is not None else None
    return compose_step(c.train_data, c.sampler, c.pool, replay_on=phase is Phase.MIXED,
                        batch_size=s.batch_size, experience_ratio=x.ratio if x else 0.0,
                        step_seed=step_seed(s.seed, step), scorer=scorer,
                        placement=x.placement if x else "displace")


def generate(c: Components, mine: list[QuestionGroup], step: int, refill_round: int = 0) -> GeneratedGroups:
    """K samples per fresh question, K-1 + the stored trajectory per replayed one, graded as they finish
    (rollout_service.py)."""
    s = c.settings
    generated = c.rollout.training_round(mine, s.group_size, s.sampling, s.seed, step, refill_round)
    if c.observers:  # the samples exist once generation is done (grading may still run)
        c.observers.notify("generated", mine, generated.samples)
    return generated


def refill_dropped_groups(c: Components, first: StepRollouts, step: int) -> StepRollouts:
    """The algorithm's group filter over the graded groups, the batch refilled with fresh groups for at most
    `algo.max_refill_rounds` extra rounds (rollout/group_filter.py: the same decision on every DP rank)."""
    def generate_round(groups: list[QuestionGroup], refill_round: int) -> tuple[list[list[Sample]], list[list[float]]]:
        generated = generate(c, groups, step, refill_round)
        return generated.samples, rewards_per_group(generated.grading.result().rewards, generated.samples)

    def draw_fresh(n: int) -> list[QuestionGroup]:
        return compose_step(c.train_data, c.sampler, c.pool, replay_on=False, batch_size=n, experience_ratio=0.0,
                            step_seed=step_seed(c.settings.seed, step), scorer=None)

    return filter_and_refill(c.algorithm.keep_group, first, generate_round=generate_round, draw_fresh=draw_fresh,
                             max_rounds=c.settings.max_refill_rounds, dp_group=c.dp_group,
                             dp_rank=c.layout.dp_rank, dp_size=c.layout.dp_size)


def with_old_logprobs(c: Components, rows: RolloutRows, mine: list[QuestionGroup]) -> tuple[TrainBatch, int]:
    """The training batch: `rows` with the pi_old of every row (algo.old_logprobs: recomputed, or the rollout's exact
    ones + the selection pass's for replays, or None: the update's own forward), and the number of rows that needed a
    forward pass here."""
    pi_old, forward_rows = old_logprobs(
        c.policy, rows, replay_current_logprobs(mine, rows), c.old_logprobs,
        temperature=c.settings.sampling.temperature, max_tokens=c.settings.micro_batch_max_tokens)
    return TrainBatch.of(rows, pi_old), forward_rows


def recomputed_mismatch(c: Components, batch: TrainBatch) -> tuple[float, float]:
    """(sum, count) of the engine-vs-trainer mismatch against a recomputed pi_old; (0, 0) otherwise (then the first
    update's forward measures it, `update_policy`)."""
    return rollout_mismatch(batch) if c.old_logprobs == "recompute" else (0.0, 0.0)


def update_policy(c: Components, batch: TrainBatch, n_groups: int, phase: Phase) -> list[UpdateMetrics]:
    """The step's mini-batch updates (the paper: 2 per step), each over its share of the groups with normalisers
    from its DP-global token and sequence counts, repeated for `trainer.update_epochs` passes over the same rows
    with the same pi_old (the batch's, from before the first update). Returns each update's result and loss
    metrics, in order (update index u counts on across passes)."""
    s = c.settings
    c.policy.train()
    updates = []
    chunks = np.array_split(np.arange(n_groups), s.updates_per_step) * s.update_epochs
    for u, chunk in enumerate(chunks):
        rows = batch.rows_of_groups(set(chunk.tolist()))
        counts = global_loss_counts([batch.response_lengths[i] for i in rows], c.dp_group)
        mbs = micro_batches_for_update(batch, rows, s.micro_batch_max_tokens, packed=s.sequence_packing,
                                       measure_mismatch=c.old_logprobs != "recompute" and u == 0)
        normalisers = c.algorithm.normalisers(*counts)
        c.observers.notify("update_started", u, mbs, phase, normalisers)
        observe = partial(c.observers.notify, "loss_computed", u) if c.observers else None
        loss_fn = rl_loss_fn(c.algorithm, phase=phase, normalisers=normalisers, temperature=s.sampling.temperature,
                             vocab_size=s.vocab_size, observe=observe)
        c.policy.zero_grad()
        metrics = c.policy.forward_backward(mbs, loss_fn, site="update")  # every rank, rows or not
        mismatch = pop_mismatch(metrics)
        loss_metrics = tuple({k: float(v) for k, v in m.items()} for m in metrics)
        updates.append(UpdateMetrics(c.policy.optimizer_step(s.skip_grad_bound), loss_metrics, mismatch))
        c.observers.notify("updated", u, updates[-1])
    return updates


def collect_into_pool(c: Components, rollouts: StepRollouts, step: int) -> None:
    """What the pool (or the response store) learns from every group graded this step, trained on or not (nothing
    without either), its age bound (`experience.max_age_steps`), then the schedule's step end (its phase follows
    the step's solved fraction)."""
    if c.pool is not None:
        c.pool.update(pool_outcomes(c.algorithm, rollouts, step, collect=c.schedule.collects))
        c.pool.expire(step)
    if c.responses is not None:  # the response store: every generated response, then its staleness bound
        c.responses.update(stored_outcomes(rollouts, step))
        c.responses.expire(step)
    all_rewards = [x for group_rewards in rollouts.graded_rewards for x in group_rewards]
    c.schedule.end_step(solved_fraction(all_rewards, c.dp_group), step)


def pool_outcomes(algorithm: RLAlgorithm, rollouts: StepRollouts, step: int, collect: bool) -> list[GroupOutcome]:
    """The algorithm's pool hook on each graded group."""
    out = []
    for g, samples, rewards in zip(rollouts.graded_groups, rollouts.graded_samples, rollouts.graded_rewards,
                                   strict=True):
        responses = [GradedResponse(np.asarray(s.response_ids, dtype=np.int32),
                                    np.asarray(s.logprobs, dtype=np.float32), x)
                     for s, x in zip(samples, rewards, strict=True)]
        outcome = algorithm.pool_outcome(g.qid, responses, step, collect)
        if outcome is not None:
            out.append(outcome)
    return out


def run_training(cfg: RootConfig, preemption: PreemptionHandler | None = None,
                 observers: Sequence[StepObserver] = (), algorithm: RLAlgorithm | None = None) -> int:
    """Train to `trainer.total_steps`; returns the process exit code (requeue code on preemption).
    `preemption`: the handler installed in start-up mode at process start (train.main), else one is here;
    a signal during start-up raises PreemptedDuringStartup (distributed/preemption.py). `observers`: receive each
    step's results (step_observer.py). `algorithm`: the one the caller built from `cfg.algo` (train.py, validating
    the config), else built here -- once per run either way."""
    preemption = preemption or PreemptionHandler().install(startup=True)
    watching = StepObservers(observers)
    p = cfg.parallel
    layout = init_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                              p.virtual_pipeline_model_parallel_size, p.context_parallel_size, seed=cfg.seed,
                              expert_model_parallel_size=p.expert_model_parallel_size,
                              expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                              collective_timeout_s=p.collective_timeout_s, collective_ledger=p.collective_ledger)
    watching.notify("distributed", layout)
    if algorithm is None:
        algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    if layout.rank == 0:
        print(startup_block(cfg, layout, algorithm), flush=True)
    c = build_components(cfg, layout, algorithm)
    c.observers = watching
    c.policy.pass_observers.append(partial(c.observers.notify, "policy_pass"))
    try:
        c.observers.notify("started", c)
        state = RunState.start(c, preemption)
    except BaseException:
        c.close()
        raise
    try:
        for step in range(state.step + 1, cfg.trainer.total_steps + 1):
            c.observers.begin(step)
            collective_watch.begin_step(step)
            metrics = train_step(c, state, step)
            if cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                metrics.update(state.validate(step))
            collective_watch.check_step(step)  # parallel.collective_ledger: the ranks issued the same collectives
            state.finish_step(step, metrics)
            c.observers.notify("step_finished", metrics)
            if state.consecutive_skips >= cfg.algo.max_consecutive_skips:
                state.save(step)
                print(f"exgrpo-train: stopping: {state.consecutive_skips} consecutive updates skipped "
                      f"(grad norm non-finite or > algo.skip_grad_bound={cfg.algo.skip_grad_bound})", file=sys.stderr)
                return 3
            if state.preempted():
                return state.stop_for_preemption(step)
            if step % cfg.checkpoint.save_every == 0 or step == cfg.trainer.total_steps:
                state.save(step)
        state.report_done()
        return 0
    except PreemptedWhileWaiting as exc:  # generating ahead: a signal while waiting for a stopped or late generator
        return state.stop_for_preemption(state.step, str(exc))
    except GeneratorFailed as exc:  # generating ahead: the generator died or missed its deadline (async_generation/)
        if state.step > 0:
            state.save(state.step)  # the last whole step; the in-flight plans without rollouts are asked for again
        print(f"exgrpo-train: {exc}", file=sys.stderr)
        return EXIT_GENERATOR_FAILED
    finally:
        state.close()
        c.close()


if __name__ == "__main__":  # pragma: no cover - use exgrpo_megatron.train
    raise SystemExit("use: python -m exgrpo_megatron.train")

