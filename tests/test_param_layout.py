"""model/param_layout: layer offsets equal megatron-core's own rule, TP shards equal megatron's own
split, name-derived splits agree with the attributes megatron sets, and, on spawned gloo ranks at
PP=2 x VPP=2 and PP=2 x TP=2, initialisation + refit gather + HF export (live buckets and the
dist-checkpoint converter) give bit for bit the tensors of the same seed's unsharded model.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.model.param_layout import TPSplit, layer_offset, tp_shard, tp_unshard
from tests.helpers.multirank import run_on_ranks

SEED = 17
BUCKET_BYTES = 16 * 1024


def _cfg(tied: bool) -> ModelConfig:
    # vocab 100 -> padded 128 (divisible by 64), so the export must trim padding rows at every layout
    return ModelConfig(family="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=2, vocab_size=100, make_vocab_size_divisible_by=64,
                       tie_word_embeddings=tied, params_dtype="fp32", layer_spec="local")


# ---------------------------------------------------------------- pure rules vs megatron-core
def _megatron_offset(num_layers: int, pp: int, pp_rank: int, vpp: int | None, vp_stage: int | None) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = SimpleNamespace(  # the fields megatron's rule reads (even split, no embedding/loss accounting)
        num_layers=num_layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False)
    return get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)


@pytest.mark.parametrize("num_layers,pp,vpp", [
    (4, 1, None), (4, 2, None), (8, 4, None), (4, 2, 2), (8, 2, 2), (12, 2, 3), (16, 4, 2), (24, 2, 4)])
def test_layer_offset_is_megatron_core_rule(num_layers, pp, vpp):
    covered = []
    for pp_rank in range(pp):
        for vp_stage in ([None] if vpp is None else range(vpp)):
            offset = layer_offset(num_layers, pp, pp_rank, vpp, vp_stage)
            assert offset == _megatron_offset(num_layers, pp, pp_rank, vpp, vp_stage), (pp_rank, vp_stage)
            covered += range(offset, offset + num_layers // (pp * (vpp or 1)))
    assert sorted(covered) == list(range(num_layers))  # every layer in exactly one chunk


def test_layer_offset_rejects_uneven_and_missing_stage():
    with pytest.raises(ValueError, match="not divisible"):
        layer_offset(6, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="vp_stage"):
        layer_offset(8, 2, 0, 2, None)
    with pytest.raises(ValueError, match="PP > 1"):
        layer_offset(8, 1, 0, 2, 1)


@pytest.mark.parametrize("dim,stride,tp", [(0, 1, 2), (0, 2, 2), (0, 2, 4), (1, 1, 2), (1, 1, 4), (0, 1, 1)])
def test_tp_shard_is_megatron_split_and_unshard_inverts_it(dim, stride, tp):
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    master = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    split = TPSplit(dim, stride)
    shards = []
    for rank in range(tp):
        shape = list(master.shape)
        shape[dim] //= tp
        weight = torch.nn.Parameter(torch.empty(shape))
        _initialize_affine_weight_cpu(weight, 16, 8, shape[dim], dim, lambda w: w.copy_(master), stride=stride,
                                      rank=rank, world_size=tp)  # megatron's own CPU split of a master weight
        assert torch.equal(tp_shard(master, split, tp, rank), weight.data), rank
        shards.append(weight.data)
    assert torch.equal(tp_unshard(shards, split), master)


# ---------------------------------------------------------------- spawned layouts vs the unsharded model
def _chunks(cfg: ModelConfig, tp: int, pp: int, vpp: int | None):
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.layout_init import initialise

    init_distributed(tp, pp, vpp, seed=5)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp)
    chunks = [build_gpt_model(cfg, parallel, vp_stage=s) for s in ([None] if vpp is None else range(vpp))]
    initialise(chunks, cfg, SEED)  # as the Policy does
    return chunks


def reference_state(cfg: ModelConfig) -> dict:
    """The unsharded model: its own named_parameters (no layout code involved) and HF mapping."""
    from exgrpo_megatron.convert.hf_mapping import megatron_to_hf

    (model,) = _chunks(cfg, 1, 1, None)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    hf = {n: t.clone() for name, p in params.items() for n, t in megatron_to_hf(name, p, cfg)}
    if cfg.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return {"params": params, "hf": hf}


def sharded_state(cfg: ModelConfig, tp: int, pp: int, vpp: int | None, ckpt_dir: str) -> dict:
    """Refit buckets, HF buckets and the split recorded on every parameter; saves a weights checkpoint."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.checkpoint.checkpointer import save_model_weights
    from exgrpo_megatron.checkpoint.compat import model_config_to_yaml
    from exgrpo_megatron.model.param_layout import named_global_params, tp_split_of_name, tp_split_of_param
    from exgrpo_megatron.rollout.refit import iter_full_param_buckets, iter_hf_weight_buckets

    chunks = _chunks(cfg, tp, pp, vpp)
    split_mismatch = [name for name, p in named_global_params(chunks, tied_copy=True)
                      if tp_split_of_name(name) != tp_split_of_param(p)]
    full = [(n, t.clone()) for b in iter_full_param_buckets(chunks, BUCKET_BYTES) for n, t in b]
    hf = [(n, t.clone()) for b in iter_hf_weight_buckets(chunks, cfg, BUCKET_BYTES) for n, t in b]
    save_model_weights(ckpt_dir, chunks, model_config_yaml=model_config_to_yaml(cfg))
    return {"full": full, "hf": hf, "split_mismatch": split_mismatch, "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "layers": [[layer.layer_number - 1 for layer in c.decoder.layers] for c in chunks]}


@pytest.mark.parametrize("tp,pp,vpp,tied", [(1, 2, 2, True), (1, 2, 2, False), (2, 2, None, False)],
                         ids=["pp2vpp2_tied", "pp2vpp2", "tp2pp2"])
def test_sharded_refit_and_hf_export_equal_unsharded_model(tp, pp, vpp, tied, tmp_path):
    from safetensors.torch import load_file

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    cfg = _cfg(tied)
    ref = run_on_ranks(reference_state, 1, args=(cfg,))[0]
    ckpt = str(tmp_path / "weights")
    ranks = run_on_ranks(sharded_state, tp * pp, args=(cfg, tp, pp, vpp, ckpt))
    if vpp:  # megatron's interleaved placement: chunk v on stage p holds layer v * PP + p
        assert [r["layers"] for r in ranks] == [[[0], [2]], [[1], [3]]]
    for r in ranks:
        assert r["split_mismatch"] == []
        names = [n for n, _ in r["full"]]
        assert sorted(names) == sorted(ref["params"]) and len(set(names)) == len(names)
        for name, t in r["full"]:
            assert torch.equal(t, ref["params"][name]), name
        hf_names = [n for n, _ in r["hf"]]
        assert sorted(hf_names) == sorted(ref["hf"]) and len(set(hf_names)) == len(hf_names)
        for name, t in r["hf"]:
            assert torch.equal(t, ref["hf"][name]), name
    out = str(tmp_path / "hf")
    convert_megatron_to_hf(ckpt, out, dtype="fp32", progress=False)
    exported = load_file(os.path.join(out, "model.safetensors"))
    expected = {n: t for n, t in ref["hf"].items() if not (tied and n == "lm_head.weight")}
    assert sorted(exported) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(exported[name], t), name
