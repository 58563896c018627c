"""An EP=2 checkpoint of a Qwen3-MoE policy (model, optimizer, LR schedule) resumes bitwise at EP=2 (the step after
the resume gives the weights of the uninterrupted run exactly) and its weights load at EP=1 (every expert where it
belongs; the optimizer state does not: megatron-core keeps the experts' Adam state in an optimizer of its own only at
EP > 1, so a full resume at EP=1 is refused at start-up naming parallel.expert_model_parallel_size)."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from tests.helpers.gather import full_tensors
from tests.helpers.multirank import run_on_ranks
from tests.test_moe_parallel import MOE, _rows


def _policy(ep: int):
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", [*MOE, f"parallel.expert_model_parallel_size={ep}"])
    layout = init_distributed(seed=cfg.seed, expert_model_parallel_size=ep)
    return cfg, layout, Policy(cfg)


def _step(cfg, layout, policy, seed: int) -> None:
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.train_batch import TrainBatch, micro_batches_for_update

    rows = _rows()
    g = torch.Generator().manual_seed(seed)  # other advantages each step
    rows = type(rows)(rows.sequences, rows.prompt_lengths, rows.behaviour_logprobs, rows.rewards,
                      torch.randn(6, generator=g).tolist(), rows.is_replay, rows.group_index)
    batch = TrainBatch.of(rows, old_logprobs=None)
    mine = [i for i in range(6) if i % layout.dp_size == layout.dp_rank]
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    counts = global_loss_counts([batch.response_lengths[i] for i in mine], ps.get_data_parallel_group())
    loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=algorithm.normalisers(*counts), temperature=1.0)
    policy.zero_grad()
    policy.forward_backward(micro_batches_for_update(batch, mine, max_tokens=32, packed=True), loss_fn, site="test")
    policy.optimizer_step(skip_grad_bound=1e9)


def save_then_continue(run_dir: str) -> dict:
    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_checkpoint

    cfg, layout, policy = _policy(2)
    _step(cfg, layout, policy, 1)
    saved = full_tensors(policy.modules, "data")
    path = save_checkpoint(run_dir, 1, model_chunks=policy.modules, optimizer=policy.optimizer,
                           opt_param_scheduler=policy.scheduler, trainer_state={}, config_yaml="",
                           model_config_yaml=model_config_to_yaml(cfg.model))
    _step(cfg, layout, policy, 2)
    return {"path": str(path), "saved": saved, "after": full_tensors(policy.modules, "data")}


def resume(path: str, ep: int) -> dict:
    from exgrpo_megatron.checkpoint import load_checkpoint

    cfg, layout, policy = _policy(ep)
    before = full_tensors(policy.modules, "data")
    # EP=1 has no separate expert optimizer (megatron chains one for the experts only at EP > 1): weights only
    load_checkpoint(path, model_chunks=policy.modules, model_config=cfg.model,
                    optimizer=policy.optimizer if ep == 2 else None,
                    opt_param_scheduler=policy.scheduler if ep == 2 else None, load_rng=False, load_pool=False)
    policy.optimizer.reload_model_params()
    loaded = full_tensors(policy.modules, "data")
    _step(cfg, layout, policy, 2)
    return {"before": before, "loaded": loaded, "after": full_tensors(policy.modules, "data")}


def resume_at_ep1_with_optimizer(path: str) -> dict:
    """A full resume (the optimizer state too) at EP=1 of the EP=2 checkpoint: refused naming the key, before
    megatron's KeyError; its weights alone (checkpoint.init_from) load at EP=1."""
    from exgrpo_megatron.checkpoint import IncompatibleCheckpointError, load_checkpoint, load_model_weights

    cfg, layout, policy = _policy(1)
    out: dict = {}
    try:
        load_checkpoint(path, model_chunks=policy.modules, model_config=cfg.model, optimizer=policy.optimizer,
                        opt_param_scheduler=policy.scheduler, load_rng=False, load_pool=False)
        out["refused"] = None
    except IncompatibleCheckpointError as err:
        out["refused"] = str(err)
    load_model_weights(path, policy.modules, model_config=cfg.model)
    out["weights"] = full_tensors(policy.modules, "data")
    return out


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory) -> dict:
    return run_on_ranks(save_then_continue, 2, args=(str(tmp_path_factory.mktemp("ep2") / "run"),))[0]


def test_ep2_checkpoint_resumed_at_ep1_is_refused_naming_the_key_and_its_weights_load(ep2_checkpoint):
    got = run_on_ranks(resume_at_ep1_with_optimizer, 2, args=(ep2_checkpoint["path"],))
    for r in got:  # old code: megatron's KeyError (optimizer.state.exp_avg... not in state dict)
        assert r["refused"] is not None and r["refused"].startswith("parallel.expert_model_parallel_size: ")
        assert "saved at EP=2, this run has EP=1" in r["refused"] and "checkpoint.init_from=" in r["refused"]
        for k, v in ep2_checkpoint["saved"].items():
            assert torch.equal(r["weights"][k], v), k


def test_ep2_checkpoint_resumes_bitwise_and_loads_at_ep1(ep2_checkpoint):
    ref = ep2_checkpoint
    for ep in (2, 1):
        got = run_on_ranks(resume, 2, args=(ref["path"], ep))[0]
        assert any(not torch.equal(got["before"][k], v) for k, v in ref["saved"].items())  # the load changed them
        for k, v in ref["saved"].items():
            assert torch.equal(got["loaded"][k], v), (ep, k)
        if ep == 2:
            for k, v in ref["after"].items():
                assert torch.equal(got["after"][k], v), k
