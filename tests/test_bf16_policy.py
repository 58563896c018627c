"""A bf16 policy on the local layer spec (a GPU without Transformer Engine runs this): every parameter is bf16 and
megatron's Float16 optimizer checkpoints it. On an H100 the first save crashed ("Optimizer shape (128,) does not
match model shape (256,)"): the local spec's torch norms stayed fp32, so the optimizer's 16-bit groups skipped them
and its state no longer lined up with the model's parameters (model/builder.py now casts them)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.multirank import run_on_ranks


def _bf16_policy_update_and_save(out_dir: str) -> list[str]:
    from exgrpo_megatron.checkpoint.model_state import save_model_and_optimizer
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", ["model.params_dtype=bf16", "model.layer_spec=local"])
    init_distributed(1, 1, seed=cfg.seed)
    policy = Policy(cfg)
    dtypes = sorted({str(p.dtype) for m in policy.modules for p in m.parameters()})
    policy.zero_grad()
    g = torch.Generator().manual_seed(0)
    for chunk in policy.chunks:
        for p in chunk.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    policy.optimizer.step()  # Adam state for every parameter: the checkpoint maps it onto the model's shards
    save_model_and_optimizer(Path(out_dir), policy.chunks, policy.optimizer)
    return dtypes


def test_bf16_local_spec_policy_is_all_bf16_and_checkpoints(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    assert run_on_ranks(_bf16_policy_update_and_save, 1, args=(str(out),))[0] == ["torch.bfloat16"]
    assert (out / "metadata.json").is_file() or any(out.iterdir())
