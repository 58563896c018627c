"""HF <-> Megatron conversion for every family: mapping units, logits equality at TP=1/TP=2/PP=2, exact round
trip, errors.

One spawned 2-rank gloo job (module fixture) loads the converted tiny Qwen2, Llama and Qwen3 checkpoints (each
built by transformers' own model class) at TP=1, TP=2 and PP=2 with megatron's own dist_checkpointing, and also
saves megatron models for the Megatron -> HF direction (Qwen2 at TP=2, Qwen3 at PP=2); the individual tests
assert on its results.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from exgrpo_megatron.config.derived import padded_vocab_size
from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.convert.hf_config import (
    UnsupportedArchitectureError,
    hf_config_from_model_config,
    model_config_from_hf,
    save_model_config,
)
from exgrpo_megatron.convert.hf_mapping import hf_to_megatron, megatron_to_hf
from exgrpo_megatron.model.param_layout import EMBEDDING, tp_split_of_name, tp_unshard
from tests.helpers.hf_families import make_hf_model
from tests.helpers.hf_families import perturb as _perturb
from tests.helpers.multirank import run_on_ranks
from tests.helpers.tp_shards import split_for_tp

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
FAMILIES = ["qwen2", "llama", "qwen3"]
SEQ = 12


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------- spawned megatron side
def _forward_logits(model, tokens: torch.Tensor, vocab: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from exgrpo_megatron.model.builder import causal_attention_mask

    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = causal_attention_mask(s, b)
    with torch.no_grad():
        if ps.get_pipeline_model_parallel_world_size() > 1:
            if ps.is_pipeline_first_stage():
                hidden = model(tokens, pos, mask)
                dist.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
                return None
            hidden = torch.empty(s, b, model.config.hidden_size)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = gather_from_tensor_model_parallel_region(model(tokens, pos, mask))
    return out[..., :vocab].clone() if ps.get_tensor_model_parallel_rank() == 0 else None


def _build(cfg: ModelConfig, tp: int, pp: int):
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.model.builder import build_gpt_model

    return build_gpt_model(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))


def _check_shards(model, cfg: ModelConfig, ckpt_dir: str) -> int:
    """Each loaded rank-local parameter equals split_for_tp(full tensor from the checkpoint)[tp_rank]."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.convert.dist_ckpt_io import DistCheckpointReader
    from exgrpo_megatron.model.param_layout import named_global_params

    reader = DistCheckpointReader(os.path.join(ckpt_dir, "model"))
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    checked = 0
    for gname, param in named_global_params([model], tied_copy=True):
        expected = split_for_tp(gname, reader.read_param(gname), tp, cfg)[rank]
        assert torch.equal(param.detach(), expected), gname
        checked += 1
    return checked


def _save_run_checkpoint(model, cfg: ModelConfig, save_root: str) -> None:
    """`model` as a run's checkpoints dir: <save_root>/step_00000003/{model/, model_config.yaml} + `latest`."""
    from megatron.core import dist_checkpointing

    from exgrpo_megatron.distributed.runtime import current_layout

    step_dir = os.path.join(save_root, "step_00000003")
    os.makedirs(os.path.join(step_dir, "model"), exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, os.path.join(step_dir, "model"))
    if current_layout().rank == 0:
        save_model_config(cfg, step_dir)
        with open(os.path.join(save_root, "latest"), "w") as f:
            f.write("step_00000003")


def _megatron_worker(ckpts: dict, tokens: dict, saves: dict):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.convert.hf_config import load_model_config
    from exgrpo_megatron.distributed.runtime import init_distributed

    out: dict = {}
    for tp, pp in LAYOUTS:
        init_distributed(tp, pp, seed=5)
        for case, ckpt_dir in ckpts.items():
            cfg = load_model_config(os.path.join(ckpt_dir, "model_config.yaml"))
            cfg.params_dtype, cfg.layer_spec = "fp32", "local"
            model = _build(cfg, tp, pp).eval()
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(ckpt_dir, "model"))
            model.load_state_dict(loaded["model"])
            out[(case, tp, pp, "checked")] = _check_shards(model, cfg, ckpt_dir)
            out[(case, tp, pp)] = _forward_logits(model, tokens[case], cfg.vocab_size)
        ps.destroy_model_parallel()
    # Megatron models saved in the run layout at TP=2 or PP=2, for the Megatron -> HF direction.
    for case, (src_cfg, tp, pp, save_root) in saves.items():
        out["rank"] = init_distributed(tp, pp, seed=11).rank
        model = _build(src_cfg, tp, pp).eval()
        _perturb(model, 3)
        _save_run_checkpoint(model, src_cfg, save_root)
        out[case] = _forward_logits(model, tokens[case], src_cfg.vocab_size)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("convert")
    hf_models, ckpts, tokens = {}, {}, {}
    for family in FAMILIES:
        hf_dir = str(root / f"hf_{family}")
        hf_models[family] = make_hf_model(family, hf_dir)
        ckpts[family] = str(root / f"mg_{family}")
        convert_hf_to_megatron(hf_dir, ckpts[family], dtype="fp32", progress=False)
        tokens[family] = _tokens(200)
    # vocab 100 padded to 128 at TP=2 (divisible_by 32): the export must trim the padding rows.
    src_cfg = ModelConfig(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                          num_query_groups=2, vocab_size=100, make_vocab_size_divisible_by=32,
                          tie_word_embeddings=False, params_dtype="fp32", layer_spec="local", rope_theta=10000.0)
    qwen3_cfg = ModelConfig(family="qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                            num_query_groups=2, kv_channels=32, vocab_size=100, make_vocab_size_divisible_by=32,
                            tie_word_embeddings=False, params_dtype="fp32", layer_spec="local", rope_theta=1e6)
    saves = {"saved_tp2": (src_cfg, 2, 1, str(root / "run_checkpoints")),
             "saved_qwen3_pp2": (qwen3_cfg, 1, 2, str(root / "run_checkpoints_qwen3"))}
    for case in saves:
        tokens[case] = _tokens(100)
    results = run_on_ranks(_megatron_worker, 2, args=(ckpts, tokens, saves))
    merged: dict = {}
    for r in results:
        merged.update({k: v for k, v in r.items() if v is not None and k != "rank"})
    return dict(root=root, hf=hf_models, ckpts=ckpts, tokens=tokens, mg=merged,
                save_roots={case: save[3] for case, save in saves.items()})


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_hf_to_megatron_logits_match_hf(converted, family, layout):
    with torch.no_grad():
        ref = converted["hf"][family](converted["tokens"][family]).logits
    got = converted["mg"][(family, *layout)]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5
    assert converted["mg"][(family, *layout, "checked")] >= 6  # every local parameter vs split_for_tp


@pytest.mark.parametrize("case,hf_class", [("saved_tp2", "Qwen2ForCausalLM"), ("saved_qwen3_pp2", "Qwen3ForCausalLM")])
def test_megatron_tp2_pp2_to_hf_from_pretrained(converted, tmp_path, case, hf_class):
    from transformers import AutoModelForCausalLM

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    out = str(tmp_path / "hf_out")
    convert_megatron_to_hf(converted["save_roots"][case], out, dtype="fp32", shard_size_gb=40_000 / 2**30,
                           progress=False)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))  # several small shards
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == hf_class
    assert model.get_input_embeddings().weight.shape[0] == 100  # padding trimmed
    with torch.no_grad():
        logits = model(converted["tokens"][case]).logits
    assert (logits - converted["mg"][case]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_hf_megatron_hf_is_exact(converted, family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    out = str(tmp_path / "back")
    convert_megatron_to_hf(converted["ckpts"][family], out, dtype="fp32", progress=False)
    orig = load_file(os.path.join(converted["root"], f"hf_{family}", "model.safetensors"))
    back = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(orig) == sorted(back)
    for name, t in orig.items():
        assert torch.equal(t, back[name]), name
    a = AutoConfig.from_pretrained(os.path.join(converted["root"], f"hf_{family}")).to_dict()
    b = AutoConfig.from_pretrained(out).to_dict()
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "rope_parameters", "tie_word_embeddings",
                "rms_norm_eps", "vocab_size", "intermediate_size"):
        assert a.get(key) == b.get(key), key


@pytest.mark.parametrize("model_type", ["mixtral", "gpt2"])
def test_unsupported_model_type_fails_clearly(tmp_path, model_type):
    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    with pytest.raises(UnsupportedArchitectureError, match=model_type):
        convert_hf_to_megatron(str(tmp_path), str(tmp_path / "out"), progress=False)


BASE_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=200, hidden_act="silu")


@pytest.mark.parametrize("extra,match", [
    (dict(attention_bias=True), "o_proj"),
    (dict(num_local_experts=8), "mixture-of-experts"),
    (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=1), "sliding-window"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "linear"),
    (dict(model_type="qwen3", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     "unsupported for qwen3"),
    (dict(model_type="qwen3", attention_bias=True), "o_proj"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 4096}), "original_max_position_embeddings"),
])
def test_unsupported_features_fail_clearly(extra, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        model_config_from_hf({**BASE_LLAMA, **extra})


def test_config_translation_round_trip():
    hf = {**BASE_LLAMA, "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "head_dim": 32,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}
    cfg = model_config_from_hf(hf)
    assert (cfg.kv_channels, cfg.rope_scaling_factor, cfg.num_query_groups) == (32, 8.0, 2)
    assert model_config_from_hf(hf_config_from_model_config(cfg)) == cfg


def test_qwen3_config_translation_and_defaults():
    """Qwen3's config class defaults head_dim to 128 (not hidden / heads): a config.json without it means 128."""
    hf = {**BASE_LLAMA, "model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 4}
    cfg = model_config_from_hf(hf)
    assert (cfg.family, cfg.kv_channels, cfg.rope_theta) == ("qwen3", 128, 10000.0)
    out = hf_config_from_model_config(cfg)
    assert (out["architectures"], out["head_dim"], out["attention_bias"]) == (["Qwen3ForCausalLM"], 128, False)
    assert model_config_from_hf(out) == cfg
    with pytest.raises(UnsupportedArchitectureError, match="qwen3"):  # the MoE family is not this one
        model_config_from_hf({**hf, "num_experts": 8})


# ---------------------------------------------------------------- pure mapping units
QCFG = ModelConfig(family="qwen2", hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=16,
                   ffn_hidden_size=96, vocab_size=100, make_vocab_size_divisible_by=16)


def _reference_qkv_rank(q, k, v, heads, groups, dim, tp, rank):
    """Independent loop construction: rank gets groups [rank*G/tp, (rank+1)*G/tp), each as its q heads, k, v."""
    rows, r, per_rank = [], heads // groups, groups // tp
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        rows += [q[h * dim:(h + 1) * dim] for h in range(g * r, (g + 1) * r)]
        rows += [k[g * dim:(g + 1) * dim], v[g * dim:(g + 1) * dim]]
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_and_fc1_tp_split_against_reference(tp):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * 16, 64, generator=g) for n in (8, 4, 4))
    qb, kb, vb = (torch.randn(n * 16, generator=g) for n in (8, 4, 4))
    pre = "decoder.layers.0."
    w = hf_to_megatron(pre + "self_attention.linear_qkv.weight", {
        "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v}, QCFG)
    b = hf_to_megatron(pre + "self_attention.linear_qkv.bias", {
        "model.layers.0.self_attn.q_proj.bias": qb, "model.layers.0.self_attn.k_proj.bias": kb,
        "model.layers.0.self_attn.v_proj.bias": vb}, QCFG)
    for rank, (ws, bs) in enumerate(zip(split_for_tp(pre + "self_attention.linear_qkv.weight", w, tp, QCFG),
                                        split_for_tp(pre + "self_attention.linear_qkv.bias", b, tp, QCFG),
                                        strict=True)):
        assert torch.equal(ws, _reference_qkv_rank(q, k, v, 8, 4, 16, tp, rank))
        assert torch.equal(bs, _reference_qkv_rank(qb, kb, vb, 8, 4, 16, tp, rank))
    gate, up = torch.randn(96, 64, generator=g), torch.randn(96, 64, generator=g)
    fc1 = hf_to_megatron(pre + "mlp.linear_fc1.weight", {"model.layers.0.mlp.gate_proj.weight": gate,
                                                         "model.layers.0.mlp.up_proj.weight": up}, QCFG)
    n = 96 // tp
    for rank, shard in enumerate(split_for_tp(pre + "mlp.linear_fc1.weight", fc1, tp, QCFG)):
        assert torch.equal(shard, torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]]))
    hf_back = dict(megatron_to_hf(pre + "self_attention.linear_qkv.weight", w, QCFG))
    assert torch.equal(hf_back["model.layers.0.self_attn.k_proj.weight"], k)
    assert torch.equal(hf_back["model.layers.0.self_attn.q_proj.weight"], q)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_merge_round_trip(tp):
    g = torch.Generator().manual_seed(1)
    shapes = {
        EMBEDDING: (128, 64), "output_layer.weight": (128, 64), "decoder.final_layernorm.weight": (64,),
        "decoder.layers.1.input_layernorm.weight": (64,),
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": (64,),  # TE name
        "decoder.layers.1.self_attention.linear_qkv.weight": (256, 64),
        "decoder.layers.1.self_attention.linear_qkv.bias": (256,),
        "decoder.layers.1.self_attention.linear_proj.weight": (64, 128),
        "decoder.layers.1.mlp.linear_fc1.weight": (192, 64), "decoder.layers.1.mlp.linear_fc2.weight": (64, 96),
    }
    for name, shape in shapes.items():
        full = torch.randn(shape, generator=g)
        shards = split_for_tp(name, full, tp, QCFG)
        assert len(shards) == tp
        merged = tp_unshard(shards, tp_split_of_name(name))  # the refit's merge (rollout/refit.py)
        if name in (EMBEDDING, "output_layer.weight"):  # re-padded as the builder pads, vocab rows preserved
            assert merged.shape[0] == padded_vocab_size(100, 16, tp)
            assert torch.equal(merged[:100], full[:100]) and not merged[100:].any()
        else:
            assert torch.equal(merged, full), name
    assert megatron_to_hf("decoder.layers.1.self_attention.linear_proj._extra_state", torch.zeros(1), QCFG) == []
    assert megatron_to_hf("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", torch.ones(64),
                          QCFG)[0][0] == "model.layers.3.post_attention_layernorm.weight"
