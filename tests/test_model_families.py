"""The family table (config/families.py) is the one description every consumer reads, checked for every family:
the megatron model the builder makes has exactly the tensors and shapes the converters' table lists, the dry run
counts exactly its parameters, and transformers' own model built from the exported config.json has exactly the
HF tensors the mapping produces. A new family entry is covered by these tests without editing them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exgrpo_megatron.config.families import FAMILIES
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.schema import CHOICES, ModelConfig
from exgrpo_megatron.convert.hf_config import hf_config_from_model_config, model_config_from_hf
from exgrpo_megatron.convert.hf_mapping import megatron_param_names, megatron_shape, megatron_to_hf
from exgrpo_megatron.planning.model_size import count_parameters
from tests.helpers.multirank import run_on_ranks


def tiny(family: str) -> ModelConfig:
    """A small model of `family`; head dim 24 != hidden / heads = 16 where the family may differ; 4 experts of width
    48, 2 per token, in a mixture-of-experts family."""
    moe = dict(num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2) if FAMILIES[family].moe else {}
    return ModelConfig(family=family, num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=2, kv_channels=24, vocab_size=100, make_vocab_size_divisible_by=32,
                       tie_word_embeddings=family == "llama", params_dtype="fp32", layer_spec="local",
                       rope_scaling_factor=8.0 if "llama3" in FAMILIES[family].rope_scaling else None, **moe)


def built_params(fused: bool) -> dict:
    """{family: {global name: shape}} of the TP=1 model the builder makes (local spec, fused norms/RoPE or not)."""
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.param_layout import named_global_params

    init_distributed(1, 1, seed=1)
    out = {}
    for family in FAMILIES:
        cfg = tiny(family)
        cfg.fused_norm_rope = fused
        model = build_gpt_model(cfg, ParallelConfig())
        out[family] = {name: tuple(p.shape) for name, p in named_global_params([model], tied_copy=False)}
    return out


@pytest.fixture(scope="module")
def megatron_models() -> dict:
    return {fused: run_on_ranks(built_params, 1, args=(fused,))[0] for fused in (True, False)}


def test_the_family_choices_are_the_table():
    assert CHOICES["model.family"] == tuple(FAMILIES)
    assert {"qwen2", "llama", "qwen3"} <= set(FAMILIES)
    for name, family in FAMILIES.items():
        assert family.name == name and family.hf_architecture.endswith("ForCausalLM")
        assert family.moe is None or family.moe.num_experts  # dense families leave the MoE keys out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused_norm_rope", "megatron_norm_rope"])
def test_builder_tensors_are_the_mapping_table_and_the_dry_run_count(megatron_models, family, fused):
    cfg = tiny(family)
    built = megatron_models[fused][family]
    assert sorted(built) == sorted(megatron_param_names(cfg))
    for name, shape in built.items():
        assert shape == megatron_shape(name, cfg), name
    assert count_parameters(cfg).total == sum(torch.Size(s).numel() for s in built.values())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_model_of_the_exported_config_has_the_mapped_tensors(family, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny(family)
    hf_cfg = hf_config_from_model_config(cfg, "float32")
    back = model_config_from_hf(hf_cfg)  # keeps every architecture field (the run settings are not in config.json)
    assert dataclasses.replace(back, name=cfg.name, make_vocab_size_divisible_by=32, params_dtype="fp32",
                               layer_spec="local") == cfg
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg))
    assert type(model).__name__ == FAMILIES[family].hf_architecture
    # The files transformers writes (their names can differ from the module's: transformers 5 fuses a MoE layer's
    # experts in memory and writes them one by one, as the published checkpoints store them)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        expected = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if not n.endswith("rotary_emb.inv_freq")}
    mapped = {}
    for name in megatron_param_names(cfg):
        for hf_name, t in megatron_to_hf(name, torch.zeros(megatron_shape(name, cfg)), cfg):
            mapped[hf_name] = tuple(t.shape)
    assert mapped == expected


def _reference_param_count(h: int, f: int, layers: int, heads: int, groups: int, d: int, vocab: int) -> float:
    """Independent float64 count of a Qwen3 model: attention (no bias) + QK-norms + SwiGLU + norms per layer,
    untied embeddings, final norm."""
    q, kv = float(heads * d), float(groups * d)
    attention = h * (q + 2 * kv) + q * h + 2.0 * d
    return layers * (attention + 3.0 * h * f + 2.0 * h) + 2.0 * vocab * h + h


def test_qwen3_8b_preset_parameter_count():
    model = load_config("exgrpo_qwen3_8b").model
    assert model.family == "qwen3"
    total = count_parameters(model).total
    assert total == _reference_param_count(4096, 12288, 36, 32, 8, 128, 151936)
    assert total == pytest.approx(8.19e9, rel=0.005)  # the Qwen3-8B model card: 8.2B (6.95B non-embedding)


def test_rope_scaling_on_a_family_without_it_is_refused_naming_the_key():
    from exgrpo_megatron.config.schema import RootConfig
    from exgrpo_megatron.config.validate import config_errors

    for family, refused in (("qwen3", True), ("qwen2", True), ("llama", False)):
        cfg = RootConfig(model=dataclasses.replace(tiny(family), rope_scaling_factor=8.0))
        errors = [e for e in config_errors(cfg, 1) if e.startswith("model.rope_scaling_factor")]
        assert bool(errors) == refused, (family, errors)


def test_model_config_yaml_with_the_old_qkv_bias_key_loads_when_it_is_the_familys(tmp_path):
    from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError, load_model_config, save_model_config

    for family in ("qwen2", "qwen3"):
        path = save_model_config(tiny(family), str(tmp_path))
        text = open(path).read()
        for saved in (True, False):
            with open(path, "w") as f:
                f.write(text + f"qkv_bias: {str(saved).lower()}\n")
            if saved == FAMILIES[family].qkv_bias:
                assert load_model_config(path) == tiny(family)
            else:
                with pytest.raises(UnsupportedArchitectureError, match="qkv_bias"):
                    load_model_config(path)


def test_a_checkpoint_of_another_family_is_refused_naming_the_family():
    """Same shapes, other tensors (Qwen2's q/k/v biases vs Qwen3's QK-norms): not loadable into each other."""
    from exgrpo_megatron.checkpoint.compat import (
        IncompatibleCheckpointError,
        check_model_compatible,
        model_config_to_yaml,
    )

    check_model_compatible(model_config_to_yaml(tiny("qwen3")), tiny("qwen3"), "ckpt")
    with pytest.raises(IncompatibleCheckpointError, match="family"):
        check_model_compatible(model_config_to_yaml(tiny("qwen2")), tiny("qwen3"), "ckpt")


def test_qwen3_8b_memory_estimate_matches_formulas():
    """The preset's plan (TP=2, sequence parallel, full recompute, distributed optimizer over DP=4), by hand: the
    QK-norms' weights are replicated over TP, and their inputs (q and k) are kept per layer."""
    from exgrpo_megatron.planning.memory_plan import estimate_memory

    cfg = load_config("exgrpo_qwen3_8b")
    est = estimate_memory(cfg, 8)
    h, f, layers, vocab, q, kv = 4096.0, 12288.0, 36, 151936.0, 4096.0, 1024.0
    sharded = h * (q + 2 * kv) + q * h + 3 * h * f
    rank_params = layers * (sharded / 2 + 2 * h + 2 * 128) + 2 * vocab * h / 2 + h  # TP=2, PP=1, untied
    assert est.weights == pytest.approx(2 * rank_params, rel=1e-9)
    assert est.optimizer == pytest.approx(12 * rank_params / 4, rel=1e-9)
    tokens = 32768.0
    recompute = tokens * layers * h / 2 * 2 + tokens * (4 * h / 2 + (3 * q + 3 * kv + 3 * f) / 2) * 2
    assert est.activations == pytest.approx(recompute + 2 * tokens * vocab / 2 * 2, rel=1e-6)
    assert est.train_peak < 80 * 2**30 and est.generation_peak < 80 * 2**30


def test_a_run_config_written_with_qkv_bias_loads_when_it_is_the_familys():
    """Run configs recorded before the family decided the q/k/v bias (bench/results' run records) still load; a
    bias the family does not have is refused naming the key."""
    from omegaconf import OmegaConf

    from exgrpo_megatron.config.loader import to_schema
    from exgrpo_megatron.config.validate import ConfigError

    assert to_schema(OmegaConf.create({"model": {"family": "qwen2", "qkv_bias": True}})).model.family == "qwen2"
    with pytest.raises(ConfigError, match="model.qkv_bias"):
        to_schema(OmegaConf.create({"model": {"family": "llama", "qkv_bias": True}}))
