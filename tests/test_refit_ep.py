"""The refit over expert parallelism (rollout/refit.py): at EP=2 (gloo) every rank streams every expert, each under
its global name and equal bit for bit to the EP=1 model's, and the HF-named stream (with LoRA adapters on the
experts, merged while streaming) equals the EP=1 one; the experts' buckets are planned identically on both ranks."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.multirank import run_on_ranks

BUCKET_BYTES = 8 * 1024


def stream_at(ep: int, lora: bool) -> dict:
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.layout_init import initialise
    from exgrpo_megatron.model.param_layout import is_adapter, named_global_params
    from exgrpo_megatron.rollout.refit import iter_full_param_buckets, iter_hf_weight_buckets

    overrides = ["model=tiny_qwen3_moe", "model.params_dtype=fp32", "model.layer_spec=local",
                 f"parallel.expert_model_parallel_size={ep}"]
    if lora:
        overrides += ["lora.rank=4", "lora.alpha=8", "lora.experts=true"]
    cfg = load_config("demo_cpu", overrides)
    init_distributed(1, 1, seed=cfg.seed, expert_model_parallel_size=ep)
    gpt = build_gpt_model(cfg.model, cfg.parallel, lora=cfg.lora if lora else None)
    initialise([gpt], cfg.model, cfg.seed, cfg.lora if lora else None)  # the same weights at every layout
    with torch.no_grad():  # non-zero B, drawn per global name: the same adapters at every layout
        for name, p in named_global_params([gpt], tied_copy=False):
            if is_adapter(name):
                g = torch.Generator().manual_seed(sum(map(ord, name)))
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    full = [b for b in iter_full_param_buckets([gpt], BUCKET_BYTES)]
    hf = [(n, t.clone()) for b in iter_hf_weight_buckets([gpt], cfg.model, BUCKET_BYTES) for n, t in b]
    return {"full": [(n, t.clone()) for b in full for n, t in b], "bucket_names": [[n for n, _ in b] for b in full],
            "hf": hf}


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora_experts"])
def test_ep2_refit_streams_every_expert_as_ep1(lora):
    ref = run_on_ranks(stream_at, 1, args=(1, lora))[0]
    ranks = run_on_ranks(stream_at, 2, args=(2, lora))
    expected = dict(ref["full"])
    assert any(".experts.local_experts.3." in n for n in expected)
    for r in ranks:
        names = [n for n, _ in r["full"]]
        assert len(names) == len(set(names)) == len(expected)  # every expert once
        got = dict(r["full"])
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name
        hf = dict(r["hf"])
        assert set(hf) == set(dict(ref["hf"]))
        for name, tensor in ref["hf"]:
            assert torch.equal(hf[name], tensor), name
        assert not any("lora" in n for n in hf)
    assert ranks[0]["bucket_names"] == ranks[1]["bucket_names"]  # the same stream on both EP ranks
