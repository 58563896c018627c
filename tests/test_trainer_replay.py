"""The training loop with a non-empty experience pool, on a tiny warm-started model.

* DP=2: the pool is really sharded -- every rank's shard holds questions, the shards are disjoint and
  owned, and their sizes add up to the pool totals the run logged; the batch is split over the ranks.
* The mixed phase really replays: experience groups carry the pool's stored trajectory as their K-th
  sample (same token ids and behaviour log-probs as the pool entry drawn), those rows are marked
  is_replay, and their loss is -A * f(w), f(w) = w / (w + beta), w = pi_theta / pi_behaviour -- checked
  against a float64 reference recomputed from the rollout batch and the model's logits, which a
  replay row treated as on-policy (-A * pi_theta / pi_old) would fail. TensorBoard gets the same scalars.

A from-scratch model solves nothing (empty pool), so a short supervised warm start (cached once per
module in a temporary directory) makes some answers correct.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks
from tests.helpers.replay_run import BATCH, STEPS, replay_overrides, run_metrics, train_warm_start
from tests.test_trainer import REQUIRED_KEYS

K = 4  # rollout.n in _overrides
BETA = 0.3  # not the default 0.1: the loss must use the configured beta
REL, ABS = 1e-4, 1e-5
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, sft_cache_dir) -> str:
    return train_warm_start(tmp_path_factory, sft_cache_dir)


# ------------------------------------------------------------------------------------------- DP=2 sharding
def _train_dp_keeping_pool(overrides: list[str]) -> dict:
    """run_training, keeping this rank's Components to report its pool shard and its groups per step."""
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    kept: dict = {}
    groups_seen: list[list[int]] = []

    class Keep(StepObserver):
        def started(self, c) -> None:
            kept["c"] = c

        def generated(self, step, groups, samples) -> None:
            groups_seen.append([g.qid for g in groups])

    cfg = load_config("demo_cpu", overrides)
    assert run_training(cfg, observers=[Keep()]) == 0
    pool = kept["c"].pool
    shard = pool.shard
    return {
        "metrics": run_metrics(cfg.logging.run_dir) if kept["c"].layout.rank == 0 else None,
        "qids": shard.question_ids(), "owned": all(pool.owns(q) for q in shard.question_ids()),
        "questions": shard.num_questions, "trajectories": shard.num_trajectories, "tokens": shard.num_tokens,
        "buckets": shard.bucket_sizes.tolist(), "retired": sorted(shard.retired), "groups": groups_seen,
    }


def test_dp2_shards_the_batch_and_agrees_on_the_totals(tmp_path, sft_dir):
    got = run_on_ranks(_train_dp_keeping_pool, 2, args=(replay_overrides(str(tmp_path / "dp2"), sft_dir),))
    logged = got[0]["metrics"]
    assert len(logged) == STEPS
    for m in logged:
        assert all(key in m for key in REQUIRED_KEYS)
    assert sum(m["experience/n_replayed"] for m in logged) > 0  # the sharded pool was drawn from
    last = logged[-1]
    for r, shard in enumerate(got):  # every rank holds a non-empty shard of questions it owns
        assert shard["questions"] > 0 and shard["trajectories"] > 0 and shard["owned"], (r, shard)
    assert not set(got[0]["qids"]) & set(got[1]["qids"])
    assert sum(s["questions"] for s in got) == last["experience/questions"]
    assert sum(s["trajectories"] for s in got) == last["experience/trajectories"]
    assert sum(s["tokens"] for s in got) == last["experience/stored_tokens"]
    for k in range(K + 1):
        assert sum(s["buckets"][k] for s in got) == last[f"experience/bucket_{k}"], k
    # retirements are replicated on every rank (a retired question is skipped by every rank's sampler)
    assert got[0]["retired"] == got[1]["retired"] and len(got[0]["retired"]) == last["experience/retired"]
    # each step's groups are split half and half over the ranks, no group twice
    for step, (mine0, mine1) in enumerate(zip(got[0]["groups"], got[1]["groups"], strict=True), start=1):
        assert len(mine0) == len(mine1) == BATCH // 2 and not set(mine0) & set(mine1), step


def test_dp2_append_keeps_every_fresh_group_and_counts_the_generation(tmp_path, sft_dir):
    """experience.placement=append over DP=2: each step trains B fresh groups plus the replayed ones, split over the
    ranks with none twice, and logs what was generated: K per fresh group, K-1 per replayed one."""
    got = run_on_ranks(_train_dp_keeping_pool, 2, args=(replay_overrides(
        str(tmp_path / "append"), sft_dir, ("experience.placement=append",)),))
    logged = got[0]["metrics"]
    assert sum(m["experience/n_replayed"] for m in logged) > 0
    total = 0.0
    for m, mine0, mine1 in zip(logged, got[0]["groups"], got[1]["groups"], strict=True):
        n = int(m["experience/n_replayed"])
        assert len(mine0) + len(mine1) == BATCH + n and len(mine0) >= BATCH // 2 <= len(mine1), m["step"]
        assert len(set(mine0) | set(mine1)) == BATCH + n  # no question twice in a step
        assert m["generation/trajectories"] == (BATCH + n) * K - n
        total += m["generation/trajectories"]
        assert m["generation/trajectories_total"] == total and m["generation/tokens"] > 0


# ------------------------------------------------------------------------------------------- replay + f(w)
def _reference_logprobs(output, labels: torch.Tensor, vocab_size: int, temperature: float):
    """float64 log softmax(logits / T)[label] over the real vocabulary (padding ids get no mass); the logits
    [b, s, V] of the last stage's output: megatron's, or from hidden states [s, b, H] x output weight (fused)."""
    if output.output_weight is None:
        x = output.tensor.detach().to(torch.float64).clone()
    else:
        x = output.tensor.detach().transpose(0, 1).double() @ output.output_weight.detach().double().t()
    assert x.shape[:2] == labels.shape, (x.shape, labels.shape)
    x[..., vocab_size:] = float("-inf")
    return torch.log_softmax(x / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _train_recording_replay(overrides: list[str]) -> dict:
    """run_training (DP=1) observing the pool's draws (the planned replays), the groups, the rollout batch and every
    loss call."""
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    steps: dict[int, dict] = {}

    class Record(StepObserver):
        def started(self, c) -> None:
            self.c = c

        def planned(self, step, groups) -> None:  # which stored trajectory was drawn, and is it in the pool?
            pool = self.c.pool
            steps[step] = {"groups": [], "samples": [], "calls": [], "choices": [
                (g.qid, g.replay.token_ids.copy(), g.replay.logprobs.copy(),
                 any(t.same_tokens(g.replay) for t in pool.shard.candidates(g.qid)))
                for g in groups if g.replay is not None]}

        def generated(self, step, groups, samples) -> None:
            steps[step]["groups"] = [(g.qid, None if g.replay is None else g.replay.token_ids.tolist(),
                                      None if g.replay is None else g.replay.logprobs.tolist()) for g in groups]
            steps[step]["samples"] = [[(list(s.response_ids), list(s.logprobs), s.is_replay) for s in grp]
                                      for grp in samples]

        def rows_built(self, step, rows) -> None:
            steps[step]["batch"] = rows

        def update_started(self, step, update, micro_batches, phase, normalisers) -> None:
            algorithm = self.c.algorithm
            self.used = {"mixed_phase": not algorithm.clips(phase), "shaping_beta": algorithm.shaping_beta,
                         "pg_normaliser": normalisers[0]}

        def loss_computed(self, step, update, output, mb, loss, metrics) -> None:
            steps[step]["calls"].append({
                "kw": self.used, "rows": list(mb.rows), "starts": [mb.row_start(b) for b in range(len(mb.rows))],
                "mask": mb.loss_mask.detach().clone(), "old": mb.loss_inputs.old_logprobs.detach().clone(),
                "logp": _reference_logprobs(output, mb.labels, cfg.model.vocab_size, cfg.rollout.temperature),
                "metrics": {k: float(v) for k, v in metrics.items()}})

    assert run_training(cfg, observers=[Record()]) == 0
    return {"steps": steps, "metrics": run_metrics(cfg.logging.run_dir)}


def _check_spliced(rec: dict) -> int:
    """Every experience group ends with the drawn pool trajectory, marked replay in the batch; returns
    the number of replay groups."""
    drawn = {qid: (ids, lps) for qid, ids, lps, in_pool in rec["choices"] if in_pool}
    assert len(drawn) == len(rec["choices"]), "a drawn trajectory is not stored in the pool"
    batch, n_replay = rec["batch"], 0
    replay_rows = [i for i, rep in enumerate(batch.is_replay) if rep]
    for g, ((qid, ids, lps), samples) in enumerate(zip(rec["groups"], rec["samples"], strict=True)):
        rows = [i for i, gi in enumerate(batch.group_index) if gi == g]
        assert len(samples) == len(rows) == K
        if ids is None:
            assert not any(rep for _, _, rep in samples) and not any(batch.is_replay[i] for i in rows)
            continue
        n_replay += 1
        assert np.array_equal(drawn[qid][0], ids) and np.array_equal(drawn[qid][1], np.float32(lps))
        *fresh, (resp, resp_lps, is_rep) = samples
        assert is_rep and resp == ids and resp_lps == pytest.approx(lps, abs=0) and not any(f[2] for f in fresh)
        last = rows[-1]
        assert batch.is_replay[last] and not any(batch.is_replay[i] for i in rows[:-1])
        assert batch.sequences[last][batch.prompt_lengths[last]:] == ids
        assert torch.equal(batch.behaviour_logprobs[last], torch.tensor(lps, dtype=torch.float32))
    assert len(replay_rows) == n_replay
    return n_replay


def _reference_loss(call: dict, batch, beta: float, replay_as_on_policy: bool = False,
                    tis_cap: float = 0.0) -> dict[str, float]:
    """float64 sums of one micro-batch (mixed phase): fresh -A*rho, rho = exp(logp - old); replay
    -A*f(w), w = exp(logp - recorded behaviour logp), f(w) = w / (w + beta). With replay_as_on_policy the
    replay rows get the fresh formula (what a trainer that ignored is_replay would compute); with tis_cap > 0
    the fresh formula times min(exp(old - recorded behaviour logp), tis_cap) (algo.settings.replay_tis_cap)."""
    out = dict(pg_sum=0.0, w_sum=0.0, f_sum=0.0, w_max=0.0, replay_tokens=0.0, tokens=0.0)
    for (r, c), i in zip(call["starts"], call["rows"], strict=True):  # (row, column) of each sequence's start
        p, n = batch.prompt_lengths[i], batch.response_lengths[i]
        span = slice(c + p - 1, c + p - 1 + n)
        assert call["mask"][r, span].all() and int(call["mask"][r, c:c + p + n].sum()) == n
        logp, adv = call["logp"][r, span], batch.advantages[i]
        out["tokens"] += n
        if batch.is_replay[i] and tis_cap > 0:
            old = call["old"][r, span].double()
            u = torch.clamp(torch.exp(old - batch.behaviour_logprobs[i].double()), max=tis_cap)
            out["pg_sum"] += float((-adv * u * torch.exp(logp - old)).sum())
            out["replay_tokens"] += n
        elif batch.is_replay[i] and not replay_as_on_policy:
            w = torch.exp(logp - batch.behaviour_logprobs[i].double())
            out["pg_sum"] += float((-adv * w / (w + beta)).sum())
            out["w_sum"] += float(w.sum())
            out["f_sum"] += float((w / (w + beta)).sum())
            out["w_max"] = max(out["w_max"], float(w.max()))
            out["replay_tokens"] += n
        else:
            out["pg_sum"] += float((-adv * torch.exp(logp - call["old"][r, span].double())).sum())
    return out


def test_mixed_phase_replays_stored_trajectories_through_policy_shaping(tmp_path, sft_dir):
    run_dir = str(tmp_path / "replay")
    got = run_on_ranks(_train_recording_replay, 1, args=(replay_overrides(
        run_dir, sft_dir, (f"logging.tensorboard={str(HAS_TENSORBOARD).lower()}",
                           f"algo.settings.shaping_beta={BETA}")),))[0]
    logged = {m["step"]: m for m in got["metrics"]}
    assert sorted(logged) == sorted(got["steps"]) == list(range(1, STEPS + 1))
    replay_steps, informative = 0, 0
    for step, rec in got["steps"].items():
        m, batch = logged[step], rec["batch"]
        assert all(key in m for key in REQUIRED_KEYS) and m["phase"] == "mixed"
        n_replay = _check_spliced(rec)
        assert m["experience/n_replayed"] == n_replay
        assert all(c["kw"]["mixed_phase"] and c["kw"]["shaping_beta"] == BETA for c in rec["calls"])
        refs = [_reference_loss(c, batch, BETA) for c in rec["calls"]]
        policy_loss = sum(r["pg_sum"] / c["kw"]["pg_normaliser"] for r, c in zip(refs, rec["calls"], strict=True))
        for r, c in zip(refs, rec["calls"], strict=True):  # each micro-batch's loss is the reference
            assert c["metrics"]["pg_loss"] * c["kw"]["pg_normaliser"] == pytest.approx(r["pg_sum"], rel=REL, abs=ABS)
        assert m["loss/policy"] == pytest.approx(policy_loss, rel=REL, abs=ABS)
        total = {k: (max if k == "w_max" else sum)(r[k] for r in refs) for k in refs[0]}
        assert total["tokens"] == sum(batch.response_lengths)  # every row trained once (in one of the 2 updates)
        if n_replay == 0:
            assert m["replay/token_fraction"] == 0.0 and m["replay/is_weight_mean"] == 0.0
            continue
        replay_steps += 1
        assert m["replay/token_fraction"] == pytest.approx(total["replay_tokens"] / total["tokens"], rel=1e-12)
        assert m["replay/is_weight_mean"] == pytest.approx(total["w_sum"] / total["replay_tokens"], rel=REL)
        assert m["replay/shaped_weight_mean"] == pytest.approx(total["f_sum"] / total["replay_tokens"], rel=REL)
        assert m["replay/is_weight_max"] == pytest.approx(total["w_max"], rel=REL)
        # the same rows as on-policy rows: a clearly different loss (replay advantages are not all zero)
        on_policy = sum(_reference_loss(c, batch, BETA, replay_as_on_policy=True)["pg_sum"] / c["kw"]["pg_normaliser"]
                        for c in rec["calls"])
        if any(batch.advantages[i] != 0 for i, rep in enumerate(batch.is_replay) if rep):
            informative += 1
            tolerance = REL * abs(policy_loss) + ABS  # what the reference had to match within
            assert abs(on_policy - m["loss/policy"]) > 100 * tolerance, (step, on_policy, m["loss/policy"])
    assert replay_steps >= 2 and informative >= 1, (replay_steps, informative)
    if HAS_TENSORBOARD:  # an optional extra: without it the run logs metrics.jsonl only
        _check_tensorboard(run_dir, got["metrics"])


def test_truncated_is_replay_term_through_the_trainer(tmp_path, sft_dir):
    """algo.settings.replay_tis_cap with append and an age bound, through the real (packed) path: each micro-batch's
    loss is the float64 reference with the truncated-IS replay term, and differs from the f(w) term on the same
    rows."""
    cap = 1.2
    got = run_on_ranks(_train_recording_replay, 1, args=(replay_overrides(str(tmp_path / "tis"), sft_dir, (
        "logging.tensorboard=false", "algo.settings.policy_shaping=false", f"algo.settings.replay_tis_cap={cap}",
        "experience.placement=append", "experience.max_age_steps=2")),))[0]
    informative = 0
    for step, rec in got["steps"].items():
        batch, n_replay = rec["batch"], _check_spliced(rec)
        assert len(rec["groups"]) == BATCH + n_replay
        refs = [_reference_loss(c, batch, BETA, tis_cap=cap) for c in rec["calls"]]
        for r, c in zip(refs, rec["calls"], strict=True):
            assert c["metrics"]["pg_loss"] * c["kw"]["pg_normaliser"] == pytest.approx(r["pg_sum"], rel=REL, abs=ABS)
        assert sum(r["tokens"] for r in refs) == sum(batch.response_lengths)
        shaped = sum(_reference_loss(c, batch, BETA)["pg_sum"] for c in rec["calls"])
        if any(batch.advantages[i] != 0 for i, rep in enumerate(batch.is_replay) if rep):
            informative += 1
            assert abs(shaped - sum(r["pg_sum"] for r in refs)) > 1e-3, step
    assert informative >= 1


def _check_tensorboard(run_dir: str, records: list[dict]) -> None:
    """TensorBoard holds every numeric metrics.jsonl scalar at every step."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    acc = ea.EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    numeric = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert numeric <= tags, numeric - tags
    for key in numeric:
        tb = {e.step: e.value for e in acc.Scalars(key)}
        for r in records:
            assert tb[r["step"]] == pytest.approx(r[key], rel=1e-6, abs=1e-6), (key, r["step"])


def _train_recording_loss_phase(overrides: list[str]) -> dict:
    """run_training (DP=1), recording through an observer whether the algorithm leaves each update unclipped
    (the mixed phase's loss) in the phase the trainer hands it."""
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    class LossPhases(StepObserver):
        def __init__(self) -> None:
            self.unclipped: list[bool] = []

        def started(self, c) -> None:
            self.algorithm = c.algorithm

        def update_started(self, step, update, micro_batches, phase, normalisers) -> None:
            self.unclipped.append(not self.algorithm.clips(phase))

    cfg = load_config("demo_cpu", overrides)
    seen = LossPhases()
    assert run_training(cfg, observers=[seen]) == 0
    return {"phases": seen.unclipped, "metrics": run_metrics(cfg.logging.run_dir)}


def test_on_policy_grpo_keeps_the_warmup_clip(tmp_path, sft_dir):
    """algo.name=grpo is on-policy GRPO: no pool and no mixed phase, so every update keeps the PPO clip,
    even with the delayed-start criterion met from step 1 (delayed_start_pass_rate=0 in _overrides). Four updates per
    step, so the clip has three chances per step to meet a group with a non-zero advantage after the policy moved."""
    got = run_on_ranks(_train_recording_loss_phase, 1, args=(replay_overrides(
        str(tmp_path / "grpo"), sft_dir, ("algo.name=grpo", "trainer.total_steps=2", "optim.lr=1e-2",
                                          "optim.adam_eps=1e-8", "trainer.ppo_mini_batch_size=4")),))[0]
    assert got["phases"] and not any(got["phases"])
    rows = got["metrics"]
    assert [r["phase"] for r in rows] == ["warmup", "warmup"] and "experience/questions" not in rows[0]
    assert all(r["experience/n_replayed"] == 0 for r in rows)
    assert 0 < max(r["reward/mean"] for r in rows) < 1  # some groups have non-zero advantages ...
    assert max(r["loss/clip_fraction"] for r in rows) > 0  # ... and the clip acts (mixed mode reports 0)
