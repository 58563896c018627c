"""The GPU check pack's CPU-runnable parts (bench/gpu_check.py): its sections run the production code (the trainer's
verbs and run_training) at toy size on the CPU, so a change to those APIs breaks this test rather than the pack on
the next GPU box; its comparison and MFU arithmetic against hand-computed values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402


def test_compare_reports_the_largest_and_mean_difference_and_relative_loss_and_grad_norm():
    a = {"old_logprobs": [-1.0, -2.0], "new_logprobs": [-1.0, -2.0], "loss": 2.0, "grad_norm": 4.0}
    b = {"old_logprobs": [-1.5, -2.0], "new_logprobs": [-1.0, -1.75], "loss": 2.5, "grad_norm": 3.0}
    out = gpu_check.compare(a, b)
    assert out["old_logprobs_max_abs_diff"] == 0.5 and out["old_logprobs_mean_abs_diff"] == 0.25
    assert out["new_logprobs_max_abs_diff"] == 0.25
    assert out["loss_rel_diff"] == 0.25 and out["grad_norm_rel_diff"] == 0.25
    with pytest.raises(ValueError):
        gpu_check.compare(a, {**b, "old_logprobs": [-1.0]})


def test_matmul_flops_count_every_matmul_weight_of_the_demo_model():
    from exgrpo_megatron.config.loader import load_config

    cfg = load_config("demo_cpu", [])
    m = cfg.model
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    per_layer = (m.hidden_size * kv * m.num_attention_heads * 2 + m.hidden_size * kv * m.num_query_groups * 2
                 + 3 * m.hidden_size * m.ffn_hidden_size)
    assert gpu_check.matmul_flops_per_token(cfg) == 2 * (m.num_layers * per_layer + m.hidden_size * m.vocab_size)


def test_derived_mfu_and_decode_roofline_from_measured_sections():
    result = {"peaks": {"bf16_matmul_tflops": 1.0, "copy_gb_per_s": 1000.0},
              "rl_step": {"matmul_flops_per_token": 2e9, "train_tokens_per_s": 100.0, "generate_tokens_per_s": 50.0,
                          "rows_per_step": 10, "params_dtype": "torch.bfloat16", "time_train_s": 1.0,
                          "time_generate_s": 3.0, "time_step_s": 4.0}}
    d = gpu_check.derived(result)
    assert d["train_mfu"] == pytest.approx(3 * 2e9 * 100 / 1e12)
    assert d["generate_mfu"] == pytest.approx(2e9 * 50 / 1e12)
    # per decode step: FLOPs 2e9 x 10 rows / 1e12 = 0.02 s; weight bytes 1e9 x 2 / 1e12 = 0.002 s -> flops-bound
    assert d["generate_roofline_bound"] == "flops"
    assert d["generate_share_of_roofline"] == pytest.approx(0.02 * 50 / 10)
    assert d["generate_share_of_step"] == pytest.approx(0.75)  # the step's generate/train split


def test_cpu_smoke_runs_the_numerics_and_the_trainer_sections(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu-smoke", "--out", str(out),
                           "--steps", "2", "--sections", "environment,numerics,rl_step,decode_attention,moe"],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["ok"] and result["environment"]["layer_spec_auto"] == "local"
    arms = result["numerics"]["arms"]
    assert arms["cpu_fp32"]["ok"] and arms["cpu_bf16"]["ok"], arms
    assert arms["cpu_fp32"]["tokens"] == arms["cpu_bf16"]["tokens"] > 0  # the same rollouts in both arms
    diff = result["numerics"]["compare"]["cpu_fp32_vs_cpu_bf16"]
    assert 0 < diff["old_logprobs_max_abs_diff"] < 0.1  # bf16 differs from fp32, but only by rounding
    step = result["rl_step"]
    assert step["ok"] and step["exit_code"] == 0
    assert step["generate_tokens_per_s"] > 0 and step["train_tokens_per_s"] > 0
    attention = result["decode_attention"]
    assert attention["ok"] and attention["engine_path"] == "explicit", attention  # fp32 in the smoke run
    assert attention["max_abs_diff"] < 1e-5 and attention["fused_us"] > 0 and attention["explicit_us"] > 0
    moe = result["moe"]
    assert moe["ok"] and moe["exit_code"] == 0 and moe["steps"] == 2, moe
    assert moe["routing_replayed_share"] > 0.5 and 0.0 <= moe["routing_disagreement"] <= 1.0


def test_cpu_smoke_runs_the_decode_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu-smoke", "--out", str(out),
                           "--sections", "decode"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    decode = json.loads(out.read_text())["decode"]
    assert decode["ok"], decode
    dense = decode["dense_demo"]
    for arm in ("chunked", "continuous_eager", "continuous_compiled"):
        assert dense[arm]["tokens"] == dense["rows"] * dense["new_tokens"], (arm, dense[arm])
        # > 0 and finite; not < 1 here: the smoke's toy weights stay in the CPU's cache, faster than the copy
        # bandwidth the roofline takes (measured on large buffers), so a share above 1 happens (1.17 measured)
        assert dense[arm]["tokens_per_s"] > 0 and 0 < dense[arm]["share_of_roofline"] < float("inf")
    moe = decode["moe_demo"]
    assert moe["chunked"]["tokens_per_s"] > 0
    assert "mixture-of-experts" in moe["continuous_eager"]["refused"]  # the continuous loop says why not
