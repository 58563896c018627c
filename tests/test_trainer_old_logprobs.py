"""pi_old without a recompute forward: taken from the rollout's own log-probs, or from the training forward of
the step's first update, each must give the loss and gradients of the recomputed pi_old (algo.old_logprobs), on a
tiny warm-started model (tests/helpers/replay_run.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks
from tests.helpers.replay_run import BATCH, STEPS, replay_overrides, run_metrics, train_warm_start


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, sft_cache_dir) -> str:
    return train_warm_start(tmp_path_factory, sft_cache_dir)


def _train_comparing_old_logprobs(overrides: list[str]) -> dict:
    """run_training with an observer that, each step, computes what the switched-off trainer uses -- pi_old
    recomputed by a forward pass of every row, before any update -- and, before each update, that update's loss and
    gradients both ways on the trainer's own micro-batches: with the recomputed pi_old (switched off) and with the
    trainer's (switched on); it then clears the gradients for the trainer's own update, whose logged loss must be the
    switched-on one. Also records the threads of the updates' passes and of generation."""
    from exgrpo_megatron.distributed.threads import available_cores
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.old_logprobs import old_logprobs
    from exgrpo_megatron.policy.train_batch import micro_batches_for_update
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    rec: dict = {"steps": [], "updates": [], "threads_train": set(), "threads_generate": set(),
                 "cores": available_cores()}

    def grads(policy) -> list[torch.Tensor]:
        return [p.main_grad.detach().clone() for ch in policy.chunks for p in ch.parameters() if p.requires_grad]

    class Compare(StepObserver):
        def started(self, c) -> None:
            self.c = c
            rec["resolved"] = c.old_logprobs

        def generated(self, step, groups, samples) -> None:  # generation's threads are the process's own
            rec["threads_generate"].add(torch.get_num_threads())

        def batch_ready(self, step, batch) -> None:
            c, s = self.c, self.c.settings
            self.batch = batch
            self.recomputed, _ = old_logprobs(c.policy, batch, [None] * len(batch.sequences), "recompute",
                                              temperature=s.sampling.temperature, max_tokens=s.micro_batch_max_tokens)
            out = batch.old_logprobs
            if out is None:  # training_forward: the update's own forward is pi_old
                rec["steps"].append({"source": c.old_logprobs, "replay_rows": sum(batch.is_replay)})
                return

            def diff(rows):
                return max((float((out[i] - self.recomputed[i]).abs().max()) for i in rows), default=0.0)
            replay = [i for i, r in enumerate(batch.is_replay) if r]
            fresh = [i for i, r in enumerate(batch.is_replay) if not r]
            rec["steps"].append({
                "source": c.old_logprobs, "replay_rows": len(replay), "replay_old_vs_recompute": diff(replay),
                "fresh_old_vs_recompute": diff(fresh),
                "replay_old_vs_behaviour": max(
                    (float((out[i] - batch.behaviour_logprobs[i]).abs().max()) for i in replay), default=0.0)})

        def update_started(self, step, update, micro_batches, phase, normalisers) -> None:
            c, s = self.c, self.c.settings
            rows = [r for mb in micro_batches for r in mb.rows]
            off = micro_batches_for_update(dataclasses.replace(self.batch, old_logprobs=self.recomputed), sorted(rows),
                                           s.micro_batch_max_tokens, packed=s.sequence_packing)
            loss_fn = rl_loss_fn(c.algorithm, phase=phase, normalisers=normalisers,
                                 temperature=s.sampling.temperature, vocab_size=s.vocab_size)
            c.policy.zero_grad()
            m_off = c.policy.forward_backward(off, loss_fn, site="test")
            g_off = grads(c.policy)
            c.policy.zero_grad()
            m_on = c.policy.forward_backward(micro_batches, loss_fn, site="test")
            g_on = grads(c.policy)
            c.policy.zero_grad()
            rec["updates"].append({
                "replay_rows": sum(self.batch.is_replay[i] for i in rows),
                "pg_on": sum(float(m["pg_loss"]) for m in m_on), "pg_off": sum(float(m["pg_loss"]) for m in m_off),
                "grad_scale": max(float(g.abs().max()) for g in g_off),
                "grad_diff": max(float((a - b).abs().max()) for a, b in zip(g_on, g_off, strict=True)),
            })

        def loss_computed(self, step, update, output, micro_batch, loss, metrics) -> None:
            rec["threads_train"].add(torch.get_num_threads())

        def updated(self, step, update, metrics) -> None:  # the trainer's own update: the switched-on loss
            rec["updates"][-1]["pg_trainer"] = sum(m["pg_loss"] for m in metrics.loss_metrics)

    assert run_training(cfg, observers=[Compare()]) == 0
    rec["threads_after"] = torch.get_num_threads()
    rec["metrics"] = run_metrics(cfg.logging.run_dir)
    return rec


def test_old_logprobs_from_the_rollout_give_the_recompute_loss_and_gradients(tmp_path, sft_dir):
    """algo.old_logprobs=auto on the megatron engine takes pi_old from the rollout (fresh rows) and from the selection
    pass (replayed rows): at a temperature that is not the selection's 1, every update (replay rows included) has the
    loss and gradients of the recompute, replayed rows' pi_old equal a fresh forward pass and not the stale behaviour
    log-probs, most replayed rows need no forward pass, the mismatch metric is measured (first update) and ~1, and
    the policy's passes ran on trainer.train_threads (auto: this machine's cores), generation on the one thread."""
    got = run_on_ranks(_train_comparing_old_logprobs, 1, args=(replay_overrides(
        str(tmp_path / "oldlp"), sft_dir, ("rollout.temperature=0.8", "algo.old_logprobs=auto")),))[0]
    assert got["resolved"] == "rollout"
    assert len(got["steps"]) == STEPS and all(s["source"] == "rollout" for s in got["steps"])
    for s in got["steps"]:
        assert s["fresh_old_vs_recompute"] < 2e-5, s  # the engine's log-probs are pi_old
        assert s["replay_old_vs_recompute"] < 2e-5, s  # the selection pass's too, at the loss temperature
    replay_steps = [s for s in got["steps"] if s["replay_rows"] > 0]
    assert len(replay_steps) >= 2, got["steps"]
    assert max(s["replay_old_vs_behaviour"] for s in replay_steps) > 1e-3  # stale pi_behaviour would not do
    assert sum(u["replay_rows"] for u in got["updates"]) > 0
    for u in got["updates"]:
        assert u["pg_on"] == pytest.approx(u["pg_off"], rel=1e-4, abs=1e-7), u
        assert u["pg_trainer"] == pytest.approx(u["pg_on"], rel=1e-6, abs=1e-9), u
        assert u["grad_diff"] <= 1e-4 * u["grad_scale"] + 1e-9, u
    logged = got["metrics"]
    replayed = sum(m["experience/n_replayed"] for m in logged)
    forward_rows = sum(m["old_logprobs/forward_rows"] for m in logged)
    assert replayed > 0 and forward_rows < replayed, (replayed, forward_rows)  # scored replays were reused
    for m in logged:
        assert m["mismatch/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4)
        assert m["mismatch/token_mult_prob_error"] >= 1.0  # measured: 0 would mean no token was counted
    assert got["threads_train"] == {got["cores"]}
    assert got["threads_generate"] == {1} and got["threads_after"] == 1


def test_old_logprobs_from_the_training_forward_give_the_recompute_loss_and_gradients(tmp_path, sft_dir):
    """algo.old_logprobs=training_forward (one update per step): no pi_old pass at all, and the one update -- replayed
    rows included -- has the loss and gradients of the recomputed pi_old; its fresh-token ratio is exactly 1
    (approx_kl 0: not the engine's log-probs, not a stale copy), and the engine-vs-trainer mismatch is still measured
    on the update's forward."""
    got = run_on_ranks(_train_comparing_old_logprobs, 1, args=(replay_overrides(
        str(tmp_path / "oldlp"), sft_dir, ("rollout.temperature=0.8", f"trainer.ppo_mini_batch_size={BATCH}",
                                            "algo.old_logprobs=training_forward")),))[0]
    assert got["resolved"] == "training_forward"
    assert len(got["steps"]) == STEPS and all(s["source"] == "training_forward" for s in got["steps"])
    assert len(got["updates"]) == STEPS and sum(u["replay_rows"] for u in got["updates"]) > 0
    for u in got["updates"]:
        assert u["pg_on"] == pytest.approx(u["pg_off"], rel=1e-4, abs=1e-7), u
        assert u["pg_trainer"] == pytest.approx(u["pg_on"], rel=1e-6, abs=1e-9), u
        assert u["grad_diff"] <= 1e-4 * u["grad_scale"] + 1e-9, u
    for m in got["metrics"]:
        assert m["old_logprobs/forward_rows"] == 0.0
        assert m["loss/approx_kl"] == 0.0 and m["loss/clip_fraction"] == 0.0
        assert 1.0 <= m["mismatch/token_mult_prob_error"] <= 1.0 + 1e-4

