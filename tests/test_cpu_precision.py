"""model.params_dtype=auto on CPU (machine/cpu_precision.py): bf16 exactly where the CPU has a bf16 matrix unit
(AMX-BF16 or AVX512-BF16, from /proc/cpuinfo's flags) and the model is at least BF16_MIN_HIDDEN_SIZE wide; fp32
elsewhere, so the demo and the fidelity preset (hidden 128) stay fp32 on every CPU, and fp32 stays one override
away for SmolLM2."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.config import derived
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.pi_old_source import resolve_old_logprobs_for
from exgrpo_megatron.machine.cpu_precision import (
    BF16_MIN_HIDDEN_SIZE,
    bf16_matrix_unit,
    cpu_auto_is_bf16,
    cpu_precision_line,
    read_cpu_flags,
)

ZEN4 = frozenset("fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni".split())
SAPPHIRE_RAPIDS = frozenset("avx512f avx512_bf16 amx_bf16 amx_tile amx_int8".split())
NO_BF16 = frozenset("fpu sse avx2 fma avx512f".split())


def test_the_matrix_unit_is_named_from_the_flags():
    assert bf16_matrix_unit(SAPPHIRE_RAPIDS) == "AMX-BF16"  # AMX first when both are present
    assert bf16_matrix_unit(ZEN4) == "AVX512-BF16"
    assert bf16_matrix_unit(NO_BF16) is None


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert read_cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert read_cpu_flags(str(tmp_path / "absent")) == frozenset()


@pytest.mark.parametrize(("unit", "hidden", "bf16"), [
    ("AVX512-BF16", BF16_MIN_HIDDEN_SIZE, True), ("AVX512-BF16", 576, True), ("AMX-BF16", 4096, True),
    ("AVX512-BF16", BF16_MIN_HIDDEN_SIZE - 1, False), ("AMX-BF16", 128, False), (None, 4096, False)])
def test_auto_is_bf16_only_with_a_unit_and_a_large_enough_model(unit, hidden, bf16):
    assert cpu_auto_is_bf16(unit, hidden) is bf16


def _resolved(preset: str, overrides: list[str], unit: str | None, monkeypatch) -> torch.dtype:
    monkeypatch.setattr(derived, "this_cpu_bf16_unit", lambda: unit)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return derived.resolve_params_dtype(load_config(preset, overrides).model)


@pytest.mark.parametrize("unit", ["AMX-BF16", "AVX512-BF16", None])
def test_demo_and_fidelity_presets_stay_fp32_on_every_cpu(unit, monkeypatch):
    for preset in ("demo_cpu", "fidelity_cpu"):
        cfg = load_config(preset, [])
        assert cfg.model.params_dtype == "auto" and cfg.model.hidden_size < BF16_MIN_HIDDEN_SIZE
        assert _resolved(preset, [], unit, monkeypatch) == torch.float32


def test_smollm2_is_bf16_under_auto_with_a_unit_and_its_rl_preset_pins_fp32(monkeypatch):
    ckpt, auto = ["checkpoint.init_from=/x"], "model.params_dtype=auto"
    assert _resolved("smollm2_word_problems", [*ckpt, auto], "AVX512-BF16", monkeypatch) == torch.bfloat16
    assert _resolved("smollm2_word_problems", [*ckpt, auto], None, monkeypatch) == torch.float32
    assert load_config("smollm2_word_problems", ckpt).model.params_dtype == "fp32"  # bf16 learns less at its lr
    assert _resolved("smollm2_word_problems", ckpt, "AMX-BF16", monkeypatch) == torch.float32


def test_a_bf16_megatron_engine_takes_the_trainers_old_logprobs_under_auto(monkeypatch):
    ckpt = ["checkpoint.init_from=/x"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(derived, "this_cpu_bf16_unit", lambda: "AVX512-BF16")
    bf16 = [*ckpt, "model.params_dtype=auto"]
    assert resolve_old_logprobs_for(load_config("smollm2_word_problems", bf16)) == "training_forward"  # 1 update
    assert resolve_old_logprobs_for(load_config("smollm2_word_problems", [*bf16, "trainer.ppo_mini_batch_size=4"])) \
        == "recompute"
    assert resolve_old_logprobs_for(load_config("smollm2_word_problems", [*ckpt, "model.params_dtype=fp32"])) \
        == "rollout"


def test_the_startup_line_says_what_and_why():
    assert cpu_precision_line("auto", "AVX512-BF16", 576, True) == (
        "CPU precision: bf16 (fp32 main params and Adam state); bf16 matrix unit AVX512-BF16; "
        f"auto: hidden size 576 >= {BF16_MIN_HIDDEN_SIZE}")
    below = cpu_precision_line("auto", "AMX-BF16", 128, False)
    assert below.endswith(f"auto: hidden size 128 < {BF16_MIN_HIDDEN_SIZE}")
    assert cpu_precision_line("auto", None, 576, False).startswith("CPU precision: fp32; no bf16 matrix unit")
    assert cpu_precision_line("fp32", "AMX-BF16", 576, False).endswith("model.params_dtype=fp32")
