"""Qwen3-MoE conversion both ways with the experts sharded over EP ranks, against transformers' own
Qwen3MoeForCausalLM (small, random-initialised from Qwen3MoeConfig, offline): HF -> megatron loaded at EP=2 gives
HF's logits; a megatron model saved at EP=2 exports to an HF directory whose model gives the megatron logits; and
HF -> megatron -> HF is bit-exact."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.hf_families import perturb
from tests.helpers.multirank import run_on_ranks
from tests.test_convert import _forward_logits, _save_run_checkpoint

SHAPE = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=256)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(7))


def _ep2_worker(ckpt_dir: str, save_root: str):
    from megatron.core import dist_checkpointing

    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.convert.hf_config import load_model_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    layout = init_distributed(seed=5, expert_model_parallel_size=2)
    cfg = load_model_config(os.path.join(ckpt_dir, "model_config.yaml"))
    cfg.params_dtype, cfg.layer_spec = "fp32", "local"
    parallel = ParallelConfig(expert_model_parallel_size=2)
    model = build_gpt_model(cfg, parallel).eval()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(ckpt_dir, "model"))
    model.load_state_dict(loaded["model"])
    experts = sorted({n.split("local_experts.")[1].split(".")[0] for n, _ in model.named_parameters()
                      if "local_experts" in n})
    out = {"ep": layout.ep_size, "local_experts": experts, "hf_to_mg": _forward_logits(model, _tokens(), 200)}
    # The other direction: new weights, saved at EP=2 as a run checkpoint.
    perturb(model, 3)
    _save_run_checkpoint(model, cfg, save_root)
    out["saved"] = _forward_logits(model, _tokens(), 200)
    return out


@pytest.fixture(scope="module")
def moe_converted(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("moe_convert")
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).float().eval()
    perturb(hf, 1)  # norms and router too: a mis-mapped tensor or a wrong expert changes the logits
    hf_dir, ckpt, saves = str(root / "hf"), str(root / "mg"), str(root / "run_checkpoints")
    hf.save_pretrained(hf_dir)
    cfg = convert_hf_to_megatron(hf_dir, ckpt, dtype="fp32", progress=False)
    results = run_on_ranks(_ep2_worker, 2, args=(ckpt, saves))
    return dict(hf=hf, hf_dir=hf_dir, ckpt=ckpt, saves=saves, cfg=cfg, ranks=results)


def test_hf_config_maps_the_moe_fields(moe_converted):
    cfg = moe_converted["cfg"]
    assert (cfg.family, cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.norm_topk_prob) == (
        "qwen3_moe", 4, 2, 48, True)


def test_hf_to_megatron_at_ep2_matches_hf_logits(moe_converted):
    r0, r1 = moe_converted["ranks"]
    assert r0["ep"] == 2 and r0["local_experts"] == ["0", "1"] and r1["local_experts"] == ["0", "1"]
    with torch.no_grad():
        ref = moe_converted["hf"](_tokens()).logits
    for r in (r0, r1):
        assert (r["hf_to_mg"] - ref).abs().max().item() <= 1e-5


def test_megatron_saved_at_ep2_exports_to_hf(moe_converted, tmp_path):
    from transformers import AutoModelForCausalLM

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    out = str(tmp_path / "hf_out")
    convert_megatron_to_hf(moe_converted["saves"], out, dtype="fp32", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.norm_topk_prob is True
    with torch.no_grad():
        logits = model(_tokens()).logits
    assert (logits - moe_converted["ranks"][0]["saved"]).abs().max().item() <= 1e-5


def test_round_trip_hf_megatron_hf_is_exact(moe_converted, tmp_path):
    from safetensors.torch import load_file

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    out = str(tmp_path / "back")
    convert_megatron_to_hf(moe_converted["ckpt"], out, dtype="fp32", progress=False)
    back = load_file(os.path.join(out, "model.safetensors"))
    orig = load_file(os.path.join(moe_converted["hf_dir"], "model.safetensors"))
    assert set(back) == set(orig)
    for k, v in orig.items():
        assert torch.equal(back[k], v), k
