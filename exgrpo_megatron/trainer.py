"""The ExGRPO training loop: one function per step, reading like the diagram in docs.

    compose batch -> generate (replays spliced) -> grade -> advantages -> pool update
    -> old log-probs -> mini-batch updates -> (engine refit) -> log / validate / checkpoint

Every rank runs this loop (SPMD). The step plan is identical on all ranks; each DP rank works on
its share of the groups, and every TP/PP rank of a replica sees identical data.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from exgrpo_megatron.algo.loss import loss_normalisers, metric_reduce_op, summarize_loss_metrics
from exgrpo_megatron.components import Components, build_components
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.data.step_plan import compose_step, local_groups
from exgrpo_megatron.distributed.preemption import PreemptionHandler
from exgrpo_megatron.distributed.runtime import init_distributed
from exgrpo_megatron.experience.types import GroupOutcome
from exgrpo_megatron.logging.startup import startup_block
from exgrpo_megatron.policy.objective import exgrpo_loss_fn
from exgrpo_megatron.policy.old_logprobs import old_logprobs, replay_current_logprobs
from exgrpo_megatron.policy.policy import updates_per_step
from exgrpo_megatron.policy.scoring import make_scorer
from exgrpo_megatron.policy.train_batch import (
    build_rollout_batch,
    micro_batches_for_update,
)
from exgrpo_megatron.reward.rollout_rewards import StreamingGrading, rewards_per_group
from exgrpo_megatron.rollout.groups import generate_groups
from exgrpo_megatron.rollout.types import SamplingParams
from exgrpo_megatron.run_state import RunState
from exgrpo_megatron.step_metrics import StepTotals, mismatch_error, pop_mismatch


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**31)


def train_step(c: Components, state: RunState, step: int) -> dict[str, float]:
    cfg, t, r, a = c.cfg, c.cfg.trainer, c.cfg.rollout, c.cfg.algo
    totals = StepTotals(c.layout)
    t0 = time.perf_counter()
    # Without a pool (trainer.experience=false: on-policy GRPO) there is no mixed phase: the fresh tokens keep
    # the PPO clip of the warm-up for the whole run, as the on-policy Dr.GRPO baseline does.
    mixed_phase = c.switch.is_on and c.pool is not None
    replay_on = mixed_phase and state.collected_once
    reuse = c.old_logprobs == "rollout"  # the selection pass keeps the replays' pi_old (at the loss temperature)
    scorer = make_scorer(c.policy, cfg.trainer.micro_batch_max_tokens, c.train_data,
                         logprob_temperature=r.temperature if reuse else None)
    # 1. compose the global batch; this rank takes its share
    groups = compose_step(c.train_data, c.sampler, c.pool, replay_on=replay_on, batch_size=t.train_batch_size,
                          experience_ratio=t.experience_ratio, step_seed=step_seed(cfg.seed, step), scorer=scorer)
    mine = local_groups(groups, c.layout.dp_rank, c.layout.dp_size)
    # 2. generate K per fresh question, K-1 + the stored trajectory per experience question; each engine
    #    batch's groups go to the grader pool as soon as they are done (graded while the next one generates)
    params = SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=r.temperature, top_p=r.top_p,
                            top_k=r.top_k, stop_strings=list(r.stop), seed=step_seed(cfg.seed, step))
    grading = StreamingGrading(c.grader, c.tokenizer, mine, cfg.reward.require_think)
    refit_before = float(getattr(c.engine, "refit_seconds_total", 0.0))  # vLLM: refits before generating if stale
    c.engine.wake()
    samples = generate_groups(c.engine, mine, r.n, params, on_chunk=grading.submit)
    c.engine.sleep()
    t_gen = time.perf_counter()
    t_refit = float(getattr(c.engine, "refit_seconds_total", 0.0)) - refit_before  # part of time/generate
    # 3. collect the grades (time/reward: the part not overlapped with generation), advantages, pool update,
    #    delayed-start switch
    graded = grading.result()
    rewards = rewards_per_group(graded.rewards, samples)
    t_rew = time.perf_counter()
    batch = build_rollout_batch(samples, rewards, a.adv_std_normalize)
    solved = totals.rewards(batch, mine, graded)
    if c.pool is not None:
        c.pool.update(group_outcomes(mine, samples, rewards, step, collect=c.switch.is_on))
        state.collected_once = state.collected_once or c.switch.is_on
    c.switch.observe(solved, step)
    # 4. old log-probs pi_old (algo.old_logprobs: recomputed, or the rollout's exact ones + the selection pass's for
    #    replays); recorded behaviour log-probs on replayed rows. Mismatch: against the recompute, else measured on
    #    the first update's forward (same weights) below.
    rows = list(range(len(batch.sequences)))
    old, old_forward_rows = old_logprobs(c.policy, batch, replay_current_logprobs(mine, batch), c.old_logprobs,
                                         temperature=r.temperature, max_tokens=t.micro_batch_max_tokens)
    behaviour = [g if (rep and a.exp_is_correct) else o
                 for g, o, rep in zip(batch.gen_logprobs, old, batch.is_replay, strict=True)]
    if not reuse:
        totals.add_mismatch(*mismatch_error(batch, old))
    t_old = time.perf_counter()
    # 5. mini-batch updates (the paper: 2 per step)
    c.policy.train()
    n_updates = updates_per_step(cfg)
    group_chunks = np.array_split(np.arange(len(mine)), n_updates)
    for u, chunk in enumerate(group_chunks):
        chunk_rows = [i for i in rows if batch.group_index[i] in set(chunk.tolist())]
        tokens = float(sum(batch.response_lengths[i] for i in chunk_rows))
        counts = totals.all_reduce_dp(torch.tensor([tokens, float(len(chunk_rows))], dtype=torch.float64))
        pg_norm, ent_norm = loss_normalisers(float(counts[0]), float(counts[1]), a.loss_agg_mode,
                                             cfg.data.max_response_length, a.loss_seqs_per_rank_ref)
        mbs = micro_batches_for_update(batch, chunk_rows, old, behaviour, t.micro_batch_max_tokens,
                                       packed=t.sequence_packing, with_generation_logprobs=reuse and u == 0)
        loss_fn = exgrpo_loss_fn(mixed_phase=mixed_phase, temperature=r.temperature, clip_ratio=a.clip_ratio,
                                 shaping_beta=a.shaping_beta, policy_shaping=a.policy_shaping,
                                 entropy_coeff=a.entropy_coeff,
                                 pg_normaliser=pg_norm, entropy_normaliser=ent_norm, vocab_size=cfg.model.vocab_size)
        c.policy.zero_grad()
        metrics = c.policy.forward_backward(mbs, loss_fn) if mbs else []
        totals.add_mismatch(*pop_mismatch(metrics))
        totals.add_loss_metrics(metrics, metric_reduce_op)
        update = c.policy.optimizer_step(a.skip_grad_bound)
        totals.add_update(update)
        state.consecutive_skips = state.consecutive_skips + 1 if update.skipped else 0
    t_train = time.perf_counter()
    out = totals.finish(summarize_loss_metrics)
    out.update({
        "phase": "mixed" if mixed_phase else "warmup",
        "experience/n_replayed": float(sum(g.replay is not None for g in groups)),
        "time/generate": t_gen - t0, "time/reward": t_rew - t_gen, "time/train": t_train - t_rew,
        "time/step": t_train - t0, "reward/grader_timeouts": float(graded.n_timeouts_killed),
        "time/old_logprobs": t_old - t_rew, "time/refit": t_refit,
        "old_logprobs/forward_rows": float(totals.all_reduce_dp(torch.tensor([float(old_forward_rows)]))[0]),
        "train/padding_share": c.policy.take_padding_share(),  # padding / token slots through the model
    })
    out["throughput/tokens_per_s"] = out.pop("tokens/total", 0.0) / max(out["time/step"], 1e-9)
    if c.pool is not None:
        out.update(c.pool.stats())
    return out


def group_outcomes(groups, samples, rewards, step: int, collect: bool) -> list[GroupOutcome]:
    """What the pool learns from each group: k correct of K; correct trajectories only once mixed
    mode is on (the original collects nothing during warm-up), retirement (k == K) always."""
    out = []
    for g, group_samples, r in zip(groups, samples, rewards, strict=True):
        k = int(sum(x == 1.0 for x in r))
        K = len(group_samples)
        if not collect and k != K:
            continue
        correct = [s for s, x in zip(group_samples, r, strict=True) if x == 1.0] if collect else []
        out.append(GroupOutcome(
            qid=g.qid, k_correct=k, group_size=K, step=step,
            correct_token_ids=[np.asarray(s.response_ids, dtype=np.int32) for s in correct],
            correct_logprobs=[np.asarray(s.logprobs, dtype=np.float32) for s in correct]))
    return out


def run_training(cfg: RootConfig, preemption: PreemptionHandler | None = None) -> int:
    """Train to `trainer.total_steps`; returns the process exit code (requeue code on preemption).
    `preemption`: the handler installed in start-up mode at process start (train.main), else one is here;
    a signal during start-up raises PreemptedDuringStartup (distributed/preemption.py)."""
    preemption = preemption or PreemptionHandler().install(startup=True)
    p = cfg.parallel
    layout = init_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                              p.virtual_pipeline_model_parallel_size, p.context_parallel_size, seed=cfg.seed)
    if layout.rank == 0:
        print(startup_block(cfg, layout), flush=True)
    c = build_components(cfg, layout)
    try:
        state = RunState.start(c, preemption)
    except BaseException:
        c.grader.close()
        raise
    try:
        for step in range(state.step + 1, cfg.trainer.total_steps + 1):
            metrics = train_step(c, state, step)
            if cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                metrics.update(state.validate(step))
            state.finish_step(step, metrics)
            if state.consecutive_skips >= cfg.algo.max_consecutive_skips:
                state.save(step)
                print(f"exgrpo-train: stopping: {state.consecutive_skips} consecutive updates skipped "
                      f"(grad norm non-finite or > algo.skip_grad_bound={cfg.algo.skip_grad_bound})", file=sys.stderr)
                return 3
            if state.preempted():
                state.save(step)
                return state.requeue_exit_code
            if step % cfg.checkpoint.save_every == 0 or step == cfg.trainer.total_steps:
                state.save(step)
        state.report_done()
        return 0
    finally:
        state.close()
        c.grader.close()


if __name__ == "__main__":  # pragma: no cover - use exgrpo_megatron.train
    raise SystemExit("use: python -m exgrpo_megatron.train")

