"""A checkpoint never computes another function silently: `checkpoint.init_from` of a converted Qwen3-MoE (transformers'
own Qwen3MoeForCausalLM, small and random: 8 experts, top-3, not renormalised) into a config that routes otherwise,
or whose RoPE theta differs, stops the trainer at start-up with exit 2 naming `model.<field>` with the checkpoint's
value and the config's; listing the fields in `checkpoint.allow_model_changes` loads it (announced). A checkpoint
that does not record a field the model reads is refused naming it; the allow list is validated.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_checkpoint_compat.py
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from exgrpo_megatron.checkpoint.compat import IncompatibleCheckpointError, check_model_compatible, model_config_to_yaml
from exgrpo_megatron.config.schema import ModelConfig

REPO = Path(__file__).resolve().parents[1]
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
HF_SHAPE = dict(vocab_size=103, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
                norm_topk_prob=False, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                max_position_embeddings=256)
# the MoE demo preset at the converted model's shape; its routing (top-2, renormalised) is the preset's own
MODEL_OVERRIDES = ["parallel.expert_model_parallel_size=1", "model.num_layers=2", "model.hidden_size=64",
                   "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=48", "model.num_attention_heads=4",
                   "model.num_query_groups=2", "model.num_experts=8", "model.max_position_embeddings=256",
                   "model.vocab_size=103", "model.params_dtype=fp32"]  # the char tokenizer's
RUN_OVERRIDES = ["trainer.total_steps=1", "trainer.train_batch_size=2", "trainer.ppo_mini_batch_size=2", "rollout.n=2",
                 "experience.admit_correct_at_most=1",
                 "trainer.sft_warm_start_steps=0", "trainer.val_every=0", "data.num_train_examples=8",
                 "checkpoint.save_every=100", "logging.progress_bar=false", "logging.tensorboard=false"]
MOE = ModelConfig(family="qwen3_moe", num_experts=8, moe_ffn_hidden_size=48, moe_router_topk=3, norm_topk_prob=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron
    from tests.helpers.hf_families import perturb

    root = tmp_path_factory.mktemp("compat")
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_SHAPE)).float().eval()
    perturb(hf, 1)
    hf.save_pretrained(root / "hf")
    convert_hf_to_megatron(str(root / "hf"), str(root / "mg"), dtype="fp32", progress=False)
    return root / "mg"


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS} | {
        "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_moe_cpu",
                           *MODEL_OVERRIDES, *RUN_OVERRIDES, f"logging.run_dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def test_init_from_with_other_routing_exits_2_naming_both_keys(converted, tmp_path):
    proc = _train(tmp_path / "run", f"checkpoint.init_from={converted}")  # old code: exit 0, trains top-2 renormalised
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.norm_topk_prob: checkpoint False, config True" in proc.stderr
    assert "model.moe_router_topk: checkpoint 3, config 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_init_from_loads_when_the_routing_fields_are_allowed_by_name(converted, tmp_path):
    proc = _train(tmp_path / "run", f"checkpoint.init_from={converted}",
                  "checkpoint.allow_model_changes=[moe_router_topk,norm_topk_prob]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.moe_router_topk: checkpoint 3, config 2 (allowed by checkpoint.allow_model_changes" in proc.stderr


def test_init_from_with_another_rope_theta_or_expert_width_exits_2(converted, tmp_path):
    routing = ["model.moe_router_topk=3", "model.norm_topk_prob=false", f"checkpoint.init_from={converted}"]
    proc = _train(tmp_path / "rope", *routing, "model.rope_theta=10000.0")  # old code: loaded "by design", exit 0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.rope_theta: checkpoint 1000000.0, config 10000.0" in proc.stderr
    proc = _train(tmp_path / "width", *routing, "model.moe_ffn_hidden_size=32")  # old: torch's CheckpointException
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.moe_ffn_hidden_size: checkpoint 48, config 32" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("field,value", [("rope_theta", 1e4), ("rms_norm_eps", 1e-5), ("rope_scaling_factor", 8.0),
                                         ("moe_router_topk", 2), ("norm_topk_prob", True), ("num_experts", 4),
                                         ("moe_ffn_hidden_size", 96), ("tie_word_embeddings", True)])
def test_every_function_field_is_compared(field, value):
    saved = model_config_to_yaml(MOE)
    with pytest.raises(IncompatibleCheckpointError, match=f"model.{field}: checkpoint .*, config {value!r}"):
        check_model_compatible(saved, dataclasses.replace(MOE, **{field: value}), "ckpt")


def test_allowed_fields_load_and_shapes_never():
    saved = model_config_to_yaml(MOE)
    check_model_compatible(saved, dataclasses.replace(MOE, rope_theta=1e4, norm_topk_prob=True), "ckpt",
                           allowed=("rope_theta", "norm_topk_prob"))
    with pytest.raises(IncompatibleCheckpointError, match="model.num_experts: checkpoint 8, config 4"):
        check_model_compatible(saved, dataclasses.replace(MOE, num_experts=4), "ckpt", allowed=("num_experts",))
    # a dense model does not read the MoE fields: not compared
    dense = ModelConfig()
    check_model_compatible(model_config_to_yaml(dense), dataclasses.replace(dense, moe_router_topk=5), "ckpt")


def test_a_checkpoint_that_does_not_record_a_field_is_refused_naming_it():
    old = {k: v for k, v in dataclasses.asdict(MOE).items() if k not in ("norm_topk_prob", "rope_scaling_factor")}
    text = yaml.safe_dump(old)
    with pytest.raises(IncompatibleCheckpointError) as err:
        check_model_compatible(text, MOE, "old_ckpt")
    message = str(err.value)
    assert "model.norm_topk_prob: the checkpoint does not record it" in message
    assert "model.rope_scaling_factor: the checkpoint does not record it" in message
    assert "tools/convert_hf_to_megatron.py" in message
    check_model_compatible(text, MOE, "old_ckpt", allowed=("norm_topk_prob", "rope_scaling_factor"))
    # an old dense checkpoint (before the MoE fields existed) loads into a dense model
    dense = {k: v for k, v in dataclasses.asdict(ModelConfig()).items()
             if k not in ("num_experts", "moe_router_topk", "norm_topk_prob", "moe_ffn_hidden_size")}
    check_model_compatible(yaml.safe_dump(dense), ModelConfig(), "old_dense")


def test_allow_model_changes_names_are_validated(capsys):
    from exgrpo_megatron.train import main

    assert main(["--config-name", "demo_moe_cpu", "--world-size", "2",
                 "checkpoint.allow_model_changes=[rope_theta,num_experts,model.rope_theta]"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.allow_model_changes: 'num_experts' is not a model field" in err
    assert "checkpoint.allow_model_changes: 'model.rope_theta' is not a model field" in err
    assert "'rope_theta' is not" not in err


def test_a_resume_announces_an_allowed_model_change():
    from exgrpo_megatron.config.loader import load_config, to_yaml
    from exgrpo_megatron.config.resume_changes import check_resume_config

    saved = load_config("demo_moe_cpu")
    now = load_config("demo_moe_cpu", ["model.rope_theta=10000.0", "checkpoint.allow_model_changes=[rope_theta]"])
    lines = check_resume_config(to_yaml(saved), now, "ckpt")
    assert lines == ["model.rope_theta: 1000000.0 -> 10000.0 (allowed by checkpoint.allow_model_changes: the saved "
                     "weights compute another function)"]


def test_float_fields_compare_at_fp32():
    """A converter reading fp32 files records the norm's epsilon as 9.9999997e-06: the model's 1e-05, accepted; a
    value that differs at fp32 is still refused (fails if the comparison is exact, or loose beyond fp32)."""
    saved = model_config_to_yaml(dataclasses.replace(MOE, rms_norm_eps=9.9999997e-06))
    check_model_compatible(saved, dataclasses.replace(MOE, rms_norm_eps=1e-05), "ckpt")
    with pytest.raises(IncompatibleCheckpointError, match="model.rms_norm_eps: checkpoint 1e-05, config 1.0001e-05"):
        check_model_compatible(model_config_to_yaml(dataclasses.replace(MOE, rms_norm_eps=1e-05)),
                               dataclasses.replace(MOE, rms_norm_eps=1.0001e-05), "ckpt")
