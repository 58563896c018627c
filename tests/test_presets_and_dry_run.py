"""Every preset resolves and validates, follows the recipe and has its model's parameter count; the dry run's
layout report, memory estimate and its refusals (exit 2 naming the key; exit 3 when the memory plan does not fit one
GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import validate
from exgrpo_megatron.logging.startup import replay_summary
from exgrpo_megatron.planning.dry_run import dry_run_report
from exgrpo_megatron.planning.memory_plan import estimate_memory
from exgrpo_megatron.planning.model_size import count_parameters
from exgrpo_megatron.planning.startup_checks import memory_startup_errors
from exgrpo_megatron.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (REPO / "conf").glob("*.yaml"))
GIB = 1024**3
PLANNED_WORLD = {"exgrpo_qwen3_30b_a3b": 16, "exgrpo_qwen3_8b_lora": 4}  # GPU presets planned for other than 8


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resolves_and_validates(preset: str) -> None:
    overrides = ["checkpoint.init_from=/ckpt/start"] if preset == "exgrpo_continual" else []
    cfg = load_config(preset, overrides)
    # the CPU presets run on one process (the MoE demo on its EP ranks), the GPU presets on 8 unless planned for more
    world = cfg.parallel.expert_model_parallel_size if preset.endswith("_cpu") else PLANNED_WORLD.get(preset, 8)
    validate(cfg, world, check_paths=False)  # the presets' models and data are not on this machine
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    report = dry_run_report(cfg, world, replay_summary(cfg, algorithm))
    assert not report.overruns and "WARNING" not in report.text, report.text


def test_presets_follow_the_recipe() -> None:
    c7 = load_config("exgrpo_7b")
    t, r, a = c7.trainer, c7.rollout, c7.algo
    assert (t.train_batch_size, r.n, r.temperature, c7.data.max_prompt_length, c7.data.max_response_length) == \
        (128, 8, 1.0, 1024, 8192)
    assert (c7.optim.lr, c7.optim.lr_schedule, t.train_batch_size // t.ppo_mini_batch_size) == (1e-6, "constant", 2)
    exgrpo = build_algorithm(a, c7.trainer, c7.data.max_response_length)
    assert (a.entropy_coeff, exgrpo.shaping_beta, exgrpo.replay_is_correction) == (0.001, 0.1, True)
    assert not exgrpo.mixed_phase_clip and exgrpo.policy_shaping and exgrpo.replay_tis_cap == 0
    x = c7.experience
    assert (x.ratio, x.delayed_start_pass_rate, x.admit_correct_above, x.admit_correct_at_most, x.retire_above(r.n),
            x.bucket_sigma, t.total_steps, c7.checkpoint.save_every, t.val_every) == \
        (0.5, 0.35, 0, 7, 7, 1.0, 701, 50, 10)
    for preset in ("exgrpo_1_5b", "exgrpo_qwen7b_instruct", "exgrpo_llama8b", "exgrpo_llama8b_instruct"):
        assert load_config(preset).trainer.total_steps == 500
    base = load_config("exgrpo_llama8b")
    assert base.experience.delayed_start_pass_rate <= 0 and base.data.template == "llama_base"
    assert base.reward.require_think is False and base.model.family == "llama"
    assert load_config("exgrpo_qwen7b_instruct").data.template == "chat"
    assert load_config("exgrpo_llama8b_instruct").data.template == "chat"


def test_continual_preset_requires_init_from(capsys, monkeypatch) -> None:
    monkeypatch.delenv("EXGRPO_INIT_FROM", raising=False)
    assert train_main(["--config-name", "exgrpo_continual", "--dry-run", "--world-size", "8"]) == 2
    assert "checkpoint.init_from" in capsys.readouterr().err
    monkeypatch.setenv("EXGRPO_INIT_FROM", "/ckpt/luffy")
    assert load_config("exgrpo_continual").checkpoint.init_from == "/ckpt/luffy"


def _reference_param_count(h: int, f: int, layers: int, heads: int, groups: int, d: int, vocab: int,
                           qkv_bias: bool, tied: bool) -> float:
    """Independent float64 count: attention + SwiGLU + norms per layer, embeddings, final norm."""
    q, kv = float(heads * d), float(groups * d)
    attention = h * (q + 2 * kv) + (q + 2 * kv if qkv_bias else 0.0) + q * h
    mlp = 3.0 * h * f
    return layers * (attention + mlp + 2.0 * h) + vocab * h * (1 if tied else 2) + h


@pytest.mark.parametrize("preset,reference,published", [
    ("exgrpo_7b", (3584, 18944, 28, 28, 4, 128, 152064, True, False), 7.62e9),
    ("exgrpo_1_5b", (1536, 8960, 28, 12, 2, 128, 151936, True, True), 1.54e9),
    ("exgrpo_llama8b", (4096, 14336, 32, 32, 8, 128, 128256, False, False), 8.03e9),
])
def test_parameter_count(preset: str, reference: tuple, published: float) -> None:
    total = count_parameters(load_config(preset).model).total
    assert total == pytest.approx(_reference_param_count(*reference), rel=1e-12)
    assert total == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("world", [8, 16])
def test_7b_dry_run_cli(world: int, capsys, preset_paths) -> None:
    assert train_main(["--config-name", "exgrpo_7b", "--dry-run", "--world-size", str(world), *preset_paths]) == 0
    out = capsys.readouterr().out
    assert f"TP=2  PP=1  CP=1  DP={world // 2}  VPP=-" in out
    assert "7,615,616,512 parameters" in out
    assert f"tokens per step <= {1024 * 9216:,}" in out and "optimizer updates per step: 2" in out
    assert "WARNING" not in out


@pytest.mark.parametrize(("overrides", "replay"), [
    ([], "experience replay (displace): mixed phase once batch pass rate > 0.35: up to 64 replayed + 64 fresh"),
    (["algo.name=grpo"], "experience replay: off (on-policy grpo)"),
    (["algo.name=rescue_replay"], "response replay: a fresh group whose responses all fail gains its question's "
                                  "newest stored success, none generated"),
    (["algo.name=ingroup_replay"], "response replay: each fresh group gains up to 8 of its question's newest stored "
                                   "responses (successes and failures), none generated"),
])
def test_dry_run_says_what_the_algorithm_replays(overrides: list[str], replay: str, capsys, preset_paths) -> None:
    """The plan's replay line is the start-up block's: replay without generation is not reported as on-policy."""
    assert train_main(["--config-name", "exgrpo_7b", "--dry-run", "--world-size", "8", *preset_paths, *overrides]) == 0
    assert f"  {replay}" in capsys.readouterr().out


def test_7b_memory_estimate_matches_formulas() -> None:
    cfg8, cfg16 = load_config("exgrpo_7b"), load_config("exgrpo_7b")
    m8, m16 = estimate_memory(cfg8, 8), estimate_memory(cfg16, 16)
    h, f, layers, vocab = 3584.0, 18944.0, 28, 152064.0
    per_layer = h * (3584 + 1024) + (3584 + 1024) + 3584 * h + 3 * h * f
    rank_params = layers * (per_layer / 2 + 2 * h) + 2 * vocab * h / 2 + h  # TP=2, PP=1, untied
    # to the distributed optimizer's alignment padding (each tensor at a multiple of 64 elements)
    assert m8.weights == pytest.approx(2 * rank_params, rel=1e-5)
    assert m8.grads == pytest.approx(4 * rank_params, rel=1e-5)
    assert m8.optimizer == pytest.approx(12 * rank_params / 4, rel=1e-5)  # distributed over DP=4
    assert m16.optimizer == pytest.approx(m8.optimizer / 2, rel=1e-6)     # DP=8 halves it
    tokens = 32768.0
    recompute = tokens * layers * h / 2 * 2 + tokens * (4 * h / 2 + (2 * 3584 + 2 * 512 + 3 * f) / 2) * 2
    logits = 2 * tokens * vocab / 2 * 2
    assert m8.activations == pytest.approx(recompute + logits, rel=1e-6)
    assert m8.generation == pytest.approx(0.5 * 80 * GIB, rel=1e-9)
    assert m8.generation_peak < 80 * GIB
    slack = 3.0 * GIB  # CUDA context + NCCL + allocator per rank
    assert m8.generation_peak == pytest.approx(m8.weights + m8.grads + m8.optimizer + m8.generation + slack)
    # without vLLM's sleep its share stays resident while training: 7B at TP=2 no longer fits
    assert m8.train_peak_without_sleep == pytest.approx(m8.train_peak + 0.5 * 80 * GIB)
    assert m8.train_peak_without_sleep > 80 * GIB


def test_dry_run_exits_3_when_a_layout_does_not_fit(capsys, preset_paths) -> None:
    args = ["--config-name", "exgrpo_7b", "--dry-run", "--world-size", "8", "--gpu-memory-gib", "80",
            "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", *preset_paths]
    assert train_main(args) == 3
    out, err = capsys.readouterr()
    assert "WARNING: does not fit: the training estimate" in out and "every estimate fits" not in out
    assert "the memory plan does not fit 80 GiB per GPU at world size 8" in err


@pytest.mark.parametrize("world, over", [(8, {"training": 9.7, "generation": 8.0}), (16, {}), (32, {})])
def test_30b_a3b_preset_fits_at_16_and_32_gpus_and_says_it_does_not_at_8(world: int, over: dict, capsys,
                                                                         preset_paths) -> None:
    """The experts' optimizer state is sharded over expert-DP = world / EP only: at 8 GPUs (expert-DP 1) each GPU
    keeps its 16 experts' fp32 master + Adam state whole, and the dry run names the estimates over 80 GiB (exit 3)."""
    assert train_main(["--config-name", "exgrpo_qwen3_30b_a3b", "--dry-run", "--world-size", str(world),
                       "--gpu-memory-gib", "80", *preset_paths]) == (3 if over else 0)
    out = capsys.readouterr().out
    est = estimate_memory(load_config("exgrpo_qwen3_30b_a3b"), world)
    experts = 48 * 128 * 3 * 2048 * 768  # every expert's fc1 + fc2
    assert est.state.expert.master == experts // 8 // (world // 8)  # 16 experts per GPU, over expert-DP
    assert est.optimizer == pytest.approx(12 * (experts / world + 1.54e9 / world), rel=2e-3)
    for phase in ("training", "generation"):
        line = f"WARNING: does not fit: the {phase} estimate"
        assert (line in out) == (phase in over), out
        if phase in over:
            assert f"exceeds 80 GiB per GPU by {over[phase]} GiB" in out and "optimizer state 42.7" in out
    assert ("memory: every estimate fits in one GPU" in out) == (not over)


def test_the_target_gpu_decides_what_fits(capsys, preset_paths) -> None:
    """The 30B-A3B preset at 8 GPUs: over on 80 GiB cards, within 141 GiB ones (an H200) by the same estimate; a run
    on such a card is refused at start-up with the fewest GPUs that fit, or allowed."""
    args = ["--config-name", "exgrpo_qwen3_30b_a3b", "--dry-run", "--world-size", "8", *preset_paths]
    assert train_main([*args, "--gpu-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "GPU target, 141 GiB" in out and "memory: every estimate fits in one GPU" in out
    cfg = load_config("exgrpo_qwen3_30b_a3b")
    assert memory_startup_errors(cfg, 8, device_memory_bytes=141 * GIB) == []
    [error] = memory_startup_errors(cfg, 8, device_memory_bytes=80 * GIB)
    assert error.startswith("parallel: at world size 8 the memory plan does not fit this 80 GiB GPU")
    assert "fits from 16 GPUs" in error and "the training estimate 89.7 GiB exceeds 80 GiB" in error
    assert memory_startup_errors(cfg, 16, device_memory_bytes=80 * GIB) == []


@pytest.mark.parametrize("args,key", [
    (["--world-size", "8", "++parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
    (["--world-size", "6"], "trainer.ppo_mini_batch_size"),
])
def test_impossible_layout_exits_2_naming_the_key(args: list[str], key: str, capsys) -> None:
    assert train_main(["--config-name", "exgrpo_7b", "--dry-run", *args]) == 2
    assert key in capsys.readouterr().err


def test_dry_run_cli_subprocess_exit_code() -> None:
    """The real command line (as the Slurm script runs it) exits 2 on an invalid layout."""
    result = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "exgrpo_7b",
                             "--dry-run", "--world-size", "6"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "DP size 3" in result.stderr


@pytest.mark.parametrize("preset, world, fewest", [("exgrpo_qwen3_8b_lora", 4, 2), ("exgrpo_qwen3_30b_a3b_lora", 8, 8)])
def test_lora_presets_fit_where_full_fine_tuning_does_not(preset: str, world: int, fewest: int, capsys,
                                                          preset_paths) -> None:
    """The LoRA presets fit at their GPU count with only the adapters' gradients and optimizer state (from `fewest`
    GPUs at their layout); their full fine-tuning parents (the same layout, lora.rank=0) do not fit there."""
    assert train_main(["--config-name", preset, "--dry-run", "--world-size", str(world), *preset_paths]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out and "memory: every estimate fits in one GPU" in out, out
    cfg = load_config(preset)
    est = estimate_memory(cfg, world)
    assert est.state.total.frozen == est.state.total.params - est.state.total.trainable > 0.95 * est.state.total.params
    assert est.grads == est.state.total.buffer * 4 < 0.05 * est.state.total.params * 4
    assert f"base {est.state.total.frozen:,} parameters frozen" in out
    assert f"adapters {est.state.total.trainable:,} parameters trained" in out
    assert f"memory: at this layout the estimates fit from {fewest} GPUs" in out
    full = estimate_memory(load_config(preset, ["lora.rank=0"]), world)
    assert max(full.train_peak, full.generation_peak) > 80 * GIB
