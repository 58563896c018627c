"""Routing replay (R3, model/routing_replay.py) on a Qwen3-MoE policy (EP=1, fp32, one gloo rank).

* The engine records, for every token it fed (prompt tokens of left-padded prefills, sampled tokens of rows that
  finish at different steps), the experts a plain teacher-forced forward of the whole sequence routes it to.
* Imposed on a training pass (padded and packed): targets equal to the router's own choices change nothing (bitwise);
  other targets are what the routers route to on the rows that have them (the router decides on the rows without:
  a trajectory replayed from the pool) and change the loss; the disagreement metric counts exactly the differing
  (token, layer) pairs, with and without replay.
* The trainer end to end with `model.moe_routing_replay=true`: the updates' forwards route every recorded token to
  the experts the engine recorded, a trajectory replayed from the pool carries no recording (its current router
  decides), and the disagreement is logged.
* Layouts and engines that cannot record or replay are refused at start-up naming the key.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate
from tests.helpers.multirank import run_on_ranks

MOE = ["model=tiny_qwen3_moe", "model.params_dtype=fp32", "model.moe_token_dispatcher=allgather"]
VOCAB = 128


def _policy(replay: bool, *extra: str):
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", [*MOE, f"model.moe_routing_replay={str(replay).lower()}", *extra])
    init_distributed(seed=cfg.seed)
    return cfg, Policy(cfg)


def engine_records_the_teacher_forced_routing() -> dict:
    from exgrpo_megatron.model.builder import causal_attention_mask
    from exgrpo_megatron.model.routing_replay import recording
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    _, policy = _policy(replay=False)
    model = policy.modules[0]
    engine = MegatronRolloutEngine(model, vocab_size=VOCAB, max_batch_sequences=8)
    prompts = [[5, 9, 17, 3], [40, 2], [7, 7, 7, 8, 9, 10]]
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3,
                                                        stop_token_ids=list(range(0, VOCAB, 8))))
    out: dict = {"shapes": [], "mismatch": [], "lengths": []}
    model.eval()
    for s in (s for g in groups for s in g):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        n = ids.shape[1]
        with torch.no_grad(), recording(policy.routing.hooks) as take:
            model(input_ids=ids, position_ids=torch.arange(n)[None], attention_mask=causal_attention_mask(n, 1))
            ref = take(n, 1)[:, 0]  # [n, layers, k]
        got = s.expert_choices
        out["shapes"].append((got.shape, n - 1, len(policy.routing.hooks)))
        out["lengths"].append(len(s.response_ids))
        out["mismatch"].append(int((np.sort(got, -1) != np.sort(ref[: n - 1], -1)).any(-1).sum()))
    return out


def test_the_engine_records_each_fed_tokens_experts():
    out = run_on_ranks(engine_records_the_teacher_forced_routing, 1)[0]
    assert len(set(out["lengths"])) > 1  # rows left the decode batch at different steps
    for (shape, fed, layers) in out["shapes"]:
        assert shape == (fed, layers, 2)
    assert out["mismatch"] == [0] * 6


def _micro_batches(packed: bool, choices):
    """One update's micro-batch (a single one) of three rows, the ExGRPO loss inputs placed."""
    from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch, micro_batches_for_update

    g = torch.Generator().manual_seed(1)
    lengths, prompts = [11, 7, 14], [4, 3, 5]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    behaviour = [-(torch.rand(n - p, generator=g) + 0.5) for n, p in zip(lengths, prompts, strict=True)]
    rows = RolloutRows(seqs, prompts, behaviour, rewards=[1.0, 0.0, 1.0], advantages=[0.8, -0.7, 0.5],
                       is_replay=[False, False, False], group_index=[0, 0, 0], expert_choices=choices)
    batch = TrainBatch.of(rows, old_logprobs=[b - 0.1 for b in behaviour])  # the loss's value follows pi_theta
    mbs = micro_batches_for_update(batch, [0, 1, 2], max_tokens=64, packed=packed)
    assert len(mbs) == 1
    return mbs, seqs


def replay_in_a_training_pass(packed: bool) -> dict:
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.model.routing_replay import recording
    from exgrpo_megatron.policy.objective import rl_loss_fn

    cfg, policy = _policy(replay=True)
    hooks = policy.routing.hooks
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=(29.0, 29.0), temperature=1.0)

    def run(mbs):
        """An update's forward and backward (no optimizer step): its loss, the experts it routed to, the metrics."""
        policy.zero_grad()
        with recording(hooks) as take:
            loss = policy.forward_backward(mbs, loss_fn, site="test")[0]["pg_loss"]
            b, s = mbs[0].tokens.shape
            routed = take(s, b)  # [s, b, layers, k]
        return loss, routed, policy.routing.take_metrics(None)

    mbs, seqs = _micro_batches(packed, None)
    free_loss, free_routed, _ = run(mbs)
    mb = mbs[0]

    def by_row(routed):  # the routing of each batch row's fed tokens, [T, layers, k]
        out = [None] * len(seqs)
        for r, (row, col) in zip(mb.rows, mb.row_starts, strict=True):
            out[r] = routed[col: col + len(seqs[r]) - 1, row]
        return out

    own = by_row(free_routed)
    same_loss, _, same_metrics = run(_micro_batches(packed, own)[0])
    # other experts for rows 0 and 2 (each set shifted by one expert: always a different set of 2 of 4); row 1 none
    shifted = [(own[0] + 1) % 4, None, (own[2] + 1) % 4]
    new_loss, new_routed, new_metrics = run(_micro_batches(packed, shifted)[0])
    used = by_row(new_routed)
    policy.routing.replay = False  # compared, not imposed
    off_loss, off_routed, off_metrics = run(_micro_batches(packed, shifted)[0])
    return {"same": bool(torch.equal(same_loss, free_loss)), "same_metrics": same_metrics,
            "imposed": [bool(np.array_equal(np.sort(u, -1), np.sort(t, -1))) for u, t in zip(used, shifted, strict=True)
                        if t is not None],
            "row1_own": bool(np.array_equal(used[1], own[1])), "changed": float((new_loss - free_loss).abs()),
            "new_metrics": new_metrics, "off_same": bool(torch.equal(off_loss, free_loss)), "off_metrics": off_metrics,
            "off_routed_own": bool(np.array_equal(off_routed, free_routed)),
            "pairs": (sum(len(q) - 1 for q in seqs), len(seqs[0]) - 1 + len(seqs[2]) - 1, mb.tokens.numel())}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_imposes_the_recorded_experts_and_counts_disagreement(packed):
    out = run_on_ranks(replay_in_a_training_pass, 1, args=(packed,))[0]
    all_fed, shifted_fed, slots = out["pairs"]
    assert out["same"] and out["same_metrics"]["moe/routing_disagreement"] == 0.0
    assert out["same_metrics"]["moe/routing_replayed_share"] == pytest.approx(all_fed / slots)
    assert out["imposed"] == [True, True] and out["row1_own"]  # no recording: the router decides
    assert out["changed"] > 1e-6
    for m in (out["new_metrics"], out["off_metrics"]):  # every shifted pair differs, row 1 is not compared
        assert m["moe/routing_disagreement"] == 1.0
        assert m["moe/routing_replayed_share"] == pytest.approx(shifted_fed / slots)
    assert out["off_same"] and out["off_routed_own"]  # replay off: compared only


def replayed_update_with_recompute(recompute: bool) -> dict:
    """One update's loss and gradients with other experts imposed on two of three rows, with or without full
    activation recompute (which re-runs the routers in the backward)."""
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.model.routing_replay import recording
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from tests.helpers.gather import full_tensors

    cfg, policy = _policy(True, f"model.recompute_activations={str(recompute).lower()}")
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=(29.0, 29.0), temperature=1.0)
    mbs, seqs = _micro_batches(True, None)
    with recording(policy.routing.hooks) as take:
        policy.forward_backward(mbs, loss_fn, forward_only=True, site="test")
        own = take(mbs[0].tokens.shape[1], 1)[:, 0]  # packed: one row, [tokens, layers, k]
    starts = [int(c) for c in mbs[0].cu_seqlens[:-1]]
    by_row = {r: own[c: c + len(seqs[r]) - 1] for r, c in zip(mbs[0].rows, starts, strict=True)}
    shifted = [(by_row[0] + 1) % 4, None, (by_row[2] + 1) % 4]
    policy.zero_grad()
    loss = policy.forward_backward(_micro_batches(True, shifted)[0], loss_fn, site="test")[0]["pg_loss"]
    return {"loss": float(loss), "grads": full_tensors(policy.modules, "grad"),
            "recompute": policy.modules[0].config.recompute_granularity}


def test_replay_survives_activation_recompute():
    """Full activation recompute re-runs each micro-batch's routers in its backward: they must route as the forward
    did, so the replayed update's loss and every gradient equal those without recompute."""
    plain = run_on_ranks(replayed_update_with_recompute, 1, args=(False,))[0]
    rec = run_on_ranks(replayed_update_with_recompute, 1, args=(True,))[0]
    assert plain["recompute"] is None and rec["recompute"] == "full"
    assert rec["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    for k, g in plain["grads"].items():
        err = float((rec["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        assert err <= 1e-5, (k, err)


class _RoutingSeen:
    """Records, for each update's micro-batches, the routing the forward used against what the engine recorded."""

    def __init__(self) -> None:
        from exgrpo_megatron.training.step_observer import StepObserver

        seen = self.seen = {"compared": 0, "equal": 0, "rows_with": 0, "replay_rows": 0, "replay_rows_with": 0}

        class Observer(StepObserver):
            def started(self, c) -> None:
                self.hooks = c.policy.routing.hooks

            def rows_built(self, step, rows) -> None:
                choices = rows.expert_choices or [None] * len(rows.sequences)
                seen["rows_with"] += sum(c is not None for c in choices)
                seen["replay_rows"] += sum(rows.is_replay)
                seen["replay_rows_with"] += sum(c is not None and r for c, r in zip(choices, rows.is_replay,
                                                                                   strict=True))

            def loss_computed(self, step, update, output, micro_batch, loss, metrics) -> None:
                recorded = [h.recorded for h in self.hooks]
                if micro_batch.expert_choices is None or any(r is None for r in recorded):
                    return
                b, s = micro_batch.tokens.shape
                used = torch.stack(recorded, 1).reshape(s, b, len(self.hooks), -1).numpy()
                for (row, col), c in zip(micro_batch.row_starts, micro_batch.expert_choices, strict=True):
                    if c is not None:
                        seen["compared"] += 1
                        seen["equal"] += int(np.array_equal(np.sort(used[col: col + len(c), row], -1),
                                                            np.sort(c, -1)))

            def policy_pass(self, step, site, micro_batches, forward_only) -> None:
                for h in self.hooks:  # record what every pass routes to (read back in loss_computed)
                    h.recording = True

        self.observer = Observer()


def train_with_routing_replay(run_dir: str, sft_cache_dir: str) -> dict:
    from exgrpo_megatron.training.trainer import run_training

    # the MoE demo model, warm-started (demo_cpu): some answers right, so the pool fills and replays from step 2
    cfg = load_config("demo_cpu", ["model=demo_qwen3_moe", "model.params_dtype=fp32",
                                   f"trainer.sft_cache_dir={sft_cache_dir}",
                                   "model.moe_token_dispatcher=allgather", "model.moe_routing_replay=true",
                                   f"logging.run_dir={run_dir}", "trainer.total_steps=2", "trainer.train_batch_size=8",
                                   "rollout.n=4", "experience.delayed_start_pass_rate=0",
                                   "trainer.ppo_mini_batch_size=4", "trainer.val_every=0",
                                   "logging.tensorboard=false", "logging.progress_bar=false"])
    seen = _RoutingSeen()
    assert run_training(cfg, observers=[seen.observer]) == 0
    from exgrpo_megatron.logging import read_metrics

    return {"seen": seen.seen, "metrics": read_metrics(f"{run_dir}/metrics.jsonl")}


def test_the_trainer_replays_the_engines_routing(tmp_path, sft_cache_dir):
    out = run_on_ranks(train_with_routing_replay, 1, args=(str(tmp_path / "run"), sft_cache_dir))[0]
    seen = out["seen"]
    # every generated row carries its recording; a trajectory replayed from the pool none (its current router decides)
    pool = [(m["phase"], m.get("experience/questions"), m["experience/n_replayed"], m["reward/mean"])
            for m in out["metrics"]]
    assert seen["replay_rows"] > 0 and seen["replay_rows_with"] == 0, pool
    assert seen["rows_with"] == 2 * 8 * 4 - seen["replay_rows"]
    assert seen["compared"] > 0 and seen["equal"] == seen["compared"]
    for m in out["metrics"]:
        assert 0.0 <= m["moe/routing_disagreement"] <= 1.0
        assert m["moe/routing_replayed_share"] > 0.5


@pytest.mark.parametrize("override, key", [
    ("rollout.engine=vllm", "model.moe_routing_replay"),
    ("rollout.max_staleness=1", "model.moe_routing_replay"),
    ("parallel.pipeline_model_parallel_size=2", "parallel.pipeline_model_parallel_size"),
])
def test_what_routing_replay_cannot_honour_is_refused(override, key):
    cfg = load_config("demo_cpu", [*MOE, "model.moe_routing_replay=true", override])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2, check_paths=False)
    assert any(line.startswith(f"{key}:") and "moe_routing_replay" in line for line in err.value.errors), \
        err.value.errors


def test_vllms_routed_experts_become_the_fed_tokens_choices():
    """vLLM (GPU: enable_return_routed_experts) returns [tokens, layers, k] with the prompt first; a sample keeps the
    fed tokens' rows (prompt + response - 1), and a missing or short array is refused rather than misaligned."""
    from exgrpo_megatron.rollout.vllm_engine import expert_choices_from_vllm

    routed = np.arange(9 * 2 * 2).reshape(9, 2, 2)
    got = expert_choices_from_vllm(routed, prompt_len=4, response_len=5)
    assert got.dtype == np.int16 and np.array_equal(got, routed[:8])
    with pytest.raises(ValueError, match="fed tokens"):
        expert_choices_from_vllm(routed[:7], prompt_len=4, response_len=5)
    with pytest.raises(ValueError, match="fed tokens"):
        expert_choices_from_vllm(None, prompt_len=4, response_len=5)
