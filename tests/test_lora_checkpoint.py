"""A LoRA checkpoint of the adapters alone (checkpoint/lora_base.py) at DP=2, unequal data per rank: saved after one
step, loaded into a policy whose weights are all wrong, the next step equals the uninterrupted one bitwise (the base
comes from the named base dir, the adapters and their Adam state from the checkpoint)."""

from __future__ import annotations

import torch

from exgrpo_megatron.config.loader import load_config
from tests.helpers.gather import full_tensors, load_full_tensors
from tests.helpers.multirank import run_on_ranks
from tests.test_parallel_invariance import _batch, _ce_loss


def _step(policy) -> None:
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.policy.batch import collate, plan_micro_batches

    seqs, prompts = _batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [i for i in range(len(seqs)) if i % dp == dp_rank]  # rows of other lengths on each rank
    normaliser = float(sum(len(s) - p for s, p in zip(seqs, prompts, strict=True)))
    plan = plan_micro_batches([len(seqs[i]) for i in mine], 32)
    policy.train()
    policy.zero_grad()
    policy.forward_backward([collate(seqs, prompts, [mine[j] for j in rows]) for rows in plan], _ce_loss(normaliser),
                            site="update")
    policy.optimizer_step(skip_grad_bound=1e9)


def _save_and_resume(root: str) -> dict:
    from exgrpo_megatron.checkpoint import load_checkpoint, model_config_to_yaml, save_checkpoint
    from exgrpo_megatron.checkpoint.lora_base import base_record
    from exgrpo_megatron.checkpoint.weights import save_model_weights
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.param_layout import is_adapter
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", ["model=tiny_qwen2", "model.params_dtype=fp32", "optim.lr=0.01",
                                   "optim.adam_eps=1e-3", "trainer.total_steps=4", "lora.rank=4", "lora.alpha=16",
                                   "parallel.use_distributed_optimizer=false"])
    init_distributed(1, 1, seed=cfg.seed)
    policy = Policy(cfg)
    save_model_weights(f"{root}/base", policy.modules, model_config_yaml=model_config_to_yaml(cfg.model))
    _step(policy)
    path = save_checkpoint(f"{root}/run", 1, model_chunks=policy.modules, optimizer=policy.optimizer,
                           opt_param_scheduler=policy.scheduler, trainer_state={"step": 1}, config_yaml="",
                           model_config_yaml=model_config_to_yaml(cfg.model), lora_base=base_record(f"{root}/base"))
    _step(policy)
    straight = full_tensors(policy.modules)

    resumed = Policy(cfg)
    load_full_tensors(resumed.modules, {n: torch.full_like(t, 0.5) for n, t in full_tensors(resumed.modules).items()})
    loaded = load_checkpoint(path, model_chunks=resumed.modules, model_config=cfg.model, optimizer=resumed.optimizer,
                             opt_param_scheduler=resumed.scheduler)
    _step(resumed)
    from megatron.core import dist_checkpointing

    saved_keys = [k for k in dist_checkpointing.load_tensors_metadata(str(path / "model"))
                  if not k.startswith("optimizer")]
    return {"straight": straight, "resumed": full_tensors(resumed.modules), "lora_base": loaded.lora_base,
            "saved_base_keys": [k for k in saved_keys if not is_adapter(k)]}


def test_adapters_only_checkpoint_resumes_bitwise_at_dp2(tmp_path):
    for got in run_on_ranks(_save_and_resume, 2, args=(str(tmp_path),)):
        assert got["lora_base"]["path"] == str((tmp_path / "base").resolve())
        assert not got["saved_base_keys"], got["saved_base_keys"]
        assert set(got["resumed"]) == set(got["straight"])
        for name, tensor in got["straight"].items():
            assert torch.equal(got["resumed"][name], tensor), name
