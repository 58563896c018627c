"""The GPU check pack: what the project does on one GPU, measured in one command of a few minutes.

Run on a bare, offline GPU box through ``tools/gpu_check.sh`` (it installs the carried wheels first); here on CPU,
``--cpu-smoke`` runs every section at toy size (tests/test_gpu_check.py). Every section runs in its own process, so
one that crashes is recorded with its error and the others still run. Sections:

* ``environment``: torch / CUDA / GPU, megatron-core, and the layer spec the run resolves: Transformer Engine's when
  it imports, else the local spec with the reason.
* ``peaks``: the machine's own limits, measured now: dense bf16 and fp32 matrix-product rate (``torch.matmul``,
  n x n x n after warm-up, TF32 off for fp32) and device-to-device copy bandwidth (bytes read + written).
* ``numerics``: one ExGRPO update of the demo model (conf/demo_cpu.yaml, local spec, pi_old recomputed) on the CPU
  and on the GPU, in fp32 and in bf16, from the same initial weights and the same rollouts (generated once, on the
  CPU, with every second group's last sample marked as a replayed trajectory whose recorded log-probs are shifted by
  0.3 so that the replay importance weights are not 1): pi_old per token, the loss, the gradient norm, and the
  log-probs after the update. Reported: the largest and mean |difference| of log-probs, the relative difference of
  loss and gradient norm, for GPU vs CPU at each precision and bf16 vs fp32 on the GPU.
* ``rl_step``: the real trainer (``run_training``) for a few steps at a Qwen2.5-1.5B shape with random weights, in
  bf16, on the arithmetic task with the character tokenizer, every rollout running to ``max_response_length`` (a
  random model never stops): generated tokens/s of our engine, trained tokens/s, step time, peak GPU memory,
  and MFU against the measured bf16 peak, with the decode's roofline (max of weight bytes / bandwidth and
  FLOPs / peak per decode step).
* ``decode_attention`` and ``decode`` (bench/gpu_decode.py): the KV-cache attention paths at the 1.5B decode shape;
  the engine's decode loops (chunked, continuous eager, continuous CUDA-graphed) at the 1.5B and the MoE demo shapes:
  tokens/s and fraction of the decode roofline.
* ``moe``: the trainer with the demo's Qwen3-MoE model and routing replay on (one device, EP=1), bf16: whether it
  runs, the engine-vs-training routing disagreement it measures, the experts' balance, the step time.

Model FLOPs per token: forward 2 * N_matmul (every matmul weight: QKV, output projection, MLP, output layer; not the
input embedding, norms or biases), training 3x forward; attention's s x s products are left out (short sequences
here: < 3% at the 1.5B shape). MFU = model FLOP/s / measured bf16 peak.

Run: ``bash tools/gpu_check.sh`` (GPU; writes bench/results/gpu_check_<card>.json) or
``.venv/bin/python bench/gpu_check.py --cpu-smoke --out /tmp/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The demo model's update on either device (numerics) and the larger trainer run (rl_step), as config overrides.
NUMERICS_OVERRIDES = ["model.layer_spec=local", "algo.old_logprobs=recompute", "rollout.n=4",
                      "trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=8", "trainer.val_every=0",
                      "trainer.sft_warm_start_steps=0", "logging.progress_bar=false", "logging.tensorboard=false"]
# Qwen2.5-1.5B's transformer body with the character tokenizer's 103 ids as the vocabulary (a random model with
# Qwen's 151,936 would sample ids the tokenizer cannot decode): 1.31 B matmul parameters instead of 1.54 B.
RL_STEP_GPU = ["model=qwen2_5_math_1_5b", "model.hf_path=null", "model.params_dtype=bf16", "model.vocab_size=103",
               "trainer.train_batch_size=64", "trainer.ppo_mini_batch_size=64", "rollout.n=8",
               "rollout.max_batch_sequences=512", "data.max_response_length=256",
               "trainer.micro_batch_max_tokens=16384"]
RL_STEP_SMOKE = ["trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=4", "rollout.n=2",
                 "data.max_response_length=8"]
RL_STEP_COMMON = ["trainer.val_every=0", "trainer.sft_warm_start_steps=0", "experience.delayed_start_pass_rate=0",
                  "checkpoint.save_every=100000", "logging.progress_bar=false", "logging.tensorboard=false"]


# ------------------------------------------------------------------------------------------ pure helpers
def compare(a: dict, b: dict) -> dict:
    """How far arm `b` is from arm `a` (numerics records): log-probs before and after the update, loss, grad norm."""
    out: dict[str, float] = {}
    for key in ("old_logprobs", "new_logprobs"):
        x, y = a[key], b[key]
        if len(x) != len(y):
            raise ValueError(f"{key}: {len(x)} vs {len(y)} tokens")
        diffs = [abs(p - q) for p, q in zip(x, y, strict=True)]
        out[f"{key}_max_abs_diff"] = max(diffs) if diffs else 0.0
        out[f"{key}_mean_abs_diff"] = sum(diffs) / max(len(diffs), 1)
    for key in ("loss", "grad_norm"):
        out[f"{key}_rel_diff"] = abs(a[key] - b[key]) / max(abs(a[key]), 1e-12)
    return out


def mean_of(records: list[dict], key: str) -> float:
    """The mean of one metric over a run's records (0 where a record lacks it)."""
    return sum(float(r.get(key, 0.0)) for r in records) / len(records)


def matmul_flops_per_token(cfg: Any) -> int:
    """2 * N_matmul: every matmul weight of the model (QKV, output projection, MLP, the output layer), counted as
    bench/train_throughput.py counts them."""
    from train_throughput import flops_per_token

    return 2 * flops_per_token(cfg.model, seq=0)[0]


# ------------------------------------------------------------------------------------------ sections
def environment() -> dict:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                           "python": sys.version.split()[0]}
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except Exception as exc:  # noqa: BLE001 - recorded, the pack goes on
        out["megatron_core"] = f"import failed: {exc!r}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, device_memory_gib=p.total_memory / 2**30, cuda=torch.version.cuda,
                   multiprocessors=p.multi_processor_count)
    try:
        import transformer_engine.pytorch  # noqa: F401

        out["transformer_engine"] = "imports"
    except (ImportError, RuntimeError) as exc:
        out["transformer_engine"] = f"does not import: {exc!r}"
    from exgrpo_megatron.config.derived import resolve_layer_spec
    from exgrpo_megatron.config.loader import load_config

    spec = resolve_layer_spec(load_config("demo_cpu", []).model)
    out["layer_spec_auto"] = spec
    out["layer_spec_reason"] = ("Transformer Engine imports with CUDA present" if spec == "te" else
                                "Transformer Engine is not importable here (or no CUDA), so model.layer_spec=auto "
                                "builds megatron-core's local spec")
    return out


def peaks(smoke: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def rate(dtype: torch.dtype, n: int, iters: int) -> float:
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        for _ in range(3):
            a @ b
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync()
        return 2 * n**3 * iters / (time.perf_counter() - t0)

    torch.backends.cuda.matmul.allow_tf32 = False
    n = 512 if smoke else 8192
    out = {"bf16_matmul_tflops": rate(torch.bfloat16, n, 3 if smoke else 20) / 1e12,
           "fp32_matmul_tflops": rate(torch.float32, n // 2, 3 if smoke else 10) / 1e12, "matmul_n": n}
    x = torch.empty(2**20 if smoke else 2**30, dtype=torch.float32, device=dev)  # 4 GiB on the GPU
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t0 = time.perf_counter()
    iters = 2 if smoke else 10
    for _ in range(iters):
        y.copy_(x)
    sync()
    out["copy_gb_per_s"] = 2 * x.numel() * 4 * iters / (time.perf_counter() - t0) / 1e9
    return out


def _numerics_arm(dtype: str, rollouts: str, smoke: bool) -> dict:
    """One ExGRPO update of the demo model on this process's device (CUDA_VISIBLE_DEVICES decides)."""
    import torch

    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import destroy_distributed, init_distributed
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.train_batch import build_rollout_rows, token_stats
    from exgrpo_megatron.reward.rollout_rewards import rewards_per_group
    from exgrpo_megatron.rollout.types import Sample
    from exgrpo_megatron.training.components import build_components
    from exgrpo_megatron.training.trainer import generate, plan_step, update_policy, with_old_logprobs

    run_dir = tempfile.mkdtemp(prefix="gpu_check_numerics_")
    overrides = NUMERICS_OVERRIDES + [f"model.params_dtype={dtype}", f"logging.run_dir={run_dir}"]
    overrides += ["data.max_response_length=16"] if smoke else []
    cfg = load_config("demo_cpu", overrides)
    layout = init_distributed(seed=cfg.seed)
    c = build_components(cfg, layout, build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length))
    try:
        if not os.path.exists(rollouts):  # the first arm (CPU, fp32) generates; every arm trains on the same
            groups = plan_step(c, 1, Phase.WARMUP)
            gen = generate(c, groups, 1)
            samples = gen.samples
            rewards = rewards_per_group(gen.grading.result().rewards, samples)
            for g in range(1, len(samples), 2):  # a replayed trajectory: recorded log-probs of an older policy
                s = samples[g][-1]
                samples[g][-1] = Sample(s.prompt_ids, s.response_ids, [x - 0.3 for x in s.logprobs],
                                        s.finish_reason, is_replay=True)
            with open(rollouts, "wb") as f:
                pickle.dump((groups, samples, rewards), f)
        with open(rollouts, "rb") as f:
            groups, samples, rewards = pickle.load(f)
        rows = build_rollout_rows(samples, rewards, c.algorithm.advantages)
        batch, _ = with_old_logprobs(c, rows, groups)
        (update,) = update_policy(c, batch, len(groups), Phase.MIXED)
        after = token_stats(c.policy, rows.sequences, rows.prompt_lengths, site="gpu_check",
                            temperature=c.settings.sampling.temperature, with_entropy=False,
                            max_tokens=c.settings.micro_batch_max_tokens).logprobs
        assert batch.old_logprobs is not None
        return {"device": str(layout.device), "dtype": dtype,
                "old_logprobs": torch.cat(batch.old_logprobs).double().tolist(),
                "new_logprobs": torch.cat(after).double().tolist(),
                "loss": sum(m["pg_loss"] - m["entropy_bonus"] for m in update.loss_metrics),
                "grad_norm": update.result.grad_norm, "skipped": update.result.skipped,
                "tokens": int(sum(rows.response_lengths)), "rows": len(rows.sequences)}
    finally:
        c.close()
        destroy_distributed()


def _rl_step_arm(steps: int, smoke: bool) -> dict:
    """The trainer at the larger shape (GPU) or the demo shape (smoke), timed from its own metrics.jsonl."""
    import torch

    from exgrpo_megatron.config.derived import resolve_params_dtype
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.logging.metrics import read_metrics
    from exgrpo_megatron.training.trainer import run_training

    run_dir = tempfile.mkdtemp(prefix="gpu_check_rl_step_")
    overrides = (RL_STEP_SMOKE if smoke else RL_STEP_GPU) + RL_STEP_COMMON
    overrides += [f"trainer.total_steps={steps}", f"logging.run_dir={run_dir}"]
    cfg = load_config("demo_cpu", overrides)
    code = run_training(cfg)
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steady = [r for r in records if r.get("step", 0) >= 2] or records  # step 1 warms the allocator and kernels
    mean = partial(mean_of, steady)
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    generated = mean("response_length/mean") * rows
    trained = mean("throughput/tokens_per_s") * mean("time/step")  # prompt + response tokens of every row
    out = {"exit_code": code, "overrides": overrides, "steps_measured": len(steady), "rows_per_step": rows,
           "params_dtype": str(resolve_params_dtype(cfg.model)), "time_step_s": mean("time/step"),
           "time_generate_s": mean("time/generate"), "time_train_s": mean("time/train"),
           "generated_tokens_per_step": generated, "generate_tokens_per_s": generated / mean("time/generate"),
           "trained_tokens_per_step": trained, "train_tokens_per_s": trained / mean("time/train"),
           "matmul_flops_per_token": matmul_flops_per_token(cfg), "reward_mean": mean("reward/mean")}
    if torch.cuda.is_available():
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def moe(steps: int, smoke: bool) -> dict:
    """The trainer with the demo's Qwen3-MoE model (4 experts, 2 per token; EP=1 on one device) and routing replay on,
    bf16 on the GPU (fp32 in the smoke run): does it run there, how often the training forward would have routed a
    token elsewhere than our engine did (moe/routing_disagreement: engine-vs-trainer arithmetic, and the weights
    moving between an update and the next), the experts' balance and the step time."""
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.logging.metrics import read_metrics
    from exgrpo_megatron.training.trainer import run_training

    run_dir = tempfile.mkdtemp(prefix="gpu_check_moe_")
    overrides = ["model=demo_qwen3_moe", "model.moe_routing_replay=true",
                 f"model.params_dtype={'fp32' if smoke else 'bf16'}", *RL_STEP_COMMON, *RL_STEP_SMOKE,
                 f"trainer.total_steps={steps}", f"logging.run_dir={run_dir}", "trainer.ppo_mini_batch_size=2"]
    cfg = load_config("demo_cpu", overrides)
    code = run_training(cfg)
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    mean = partial(mean_of, records)
    return {"exit_code": code, "overrides": overrides, "steps": len(records),
            "routing_disagreement": mean("moe/routing_disagreement"),
            "routing_replayed_share": mean("moe/routing_replayed_share"),
            "load_max_over_mean": mean("moe/load_max_over_mean"), "time_step_s": mean("time/step"),
            "reward_mean": mean("reward/mean")}


def derived(result: dict) -> dict:
    """MFU and roofline shares from the measured sections (when both ran)."""
    pk, step = result.get("peaks", {}), result.get("rl_step", {})
    if "bf16_matmul_tflops" not in pk or "time_train_s" not in step:
        return {}
    peak, bw = pk["bf16_matmul_tflops"] * 1e12, pk["copy_gb_per_s"] * 1e9
    f = step["matmul_flops_per_token"]
    train_mfu = 3 * f * step["train_tokens_per_s"] / peak
    decode_flops = f * step["generate_tokens_per_s"]
    steps_per_s = step["generate_tokens_per_s"] / step["rows_per_step"]  # decode steps/s with every row running
    bytes_per_step = f // 2 * (2 if "bfloat16" in step["params_dtype"] else 4)
    roofline_s_per_step = max(f * step["rows_per_step"] / peak, bytes_per_step / bw)
    return {"train_mfu": train_mfu, "generate_mfu": decode_flops / peak,
            "generate_share_of_step": step["time_generate_s"] / step["time_step_s"],
            "generate_share_of_roofline": roofline_s_per_step * steps_per_s,
            "generate_roofline_bound": "flops" if f * step["rows_per_step"] / peak > bytes_per_step / bw else "bytes"}


# ------------------------------------------------------------------------------------------ driver
def _run_section(args: list[str], env: dict[str, str] | None, timeout: float) -> dict:
    """A section in its own process; its JSON is the last stdout line. A crash is recorded, not raised."""
    cmd = [sys.executable, __file__, "--section", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                              cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "stderr_tail": str(exc.stderr)[-2000:]}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    out = json.loads(lines[-1])
    out.update(ok=True, seconds=time.perf_counter() - t0)
    return out


SECTIONS = ("environment", "peaks", "numerics", "rl_step", "decode_attention", "decode", "moe")
TIMEOUT_S = {"environment": 300, "peaks": 300, "rl_step": 900, "decode_attention": 300, "decode": 600, "moe": 600}


def run_all(out_path: str, smoke: bool, steps: int, sections: tuple[str, ...] = SECTIONS) -> dict:
    import torch

    gpu = torch.cuda.is_available() and not smoke
    result: dict[str, Any] = {"smoke": smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    result["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
                                      ).stdout.strip() or "unknown"
    for name in (n for n in SECTIONS if n in sections):  # each in its own process, numerics one per arm
        args = [name, *([str(steps)] if name in ("rl_step", "moe") else []), *(["--smoke"] if smoke else [])]
        result[name] = _numerics(gpu, smoke) if name == "numerics" else _run_section(args, None, TIMEOUT_S[name])
    result["derived"] = derived(result)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _numerics(gpu: bool, smoke: bool) -> dict:
    """The four numerics arms (two on the CPU only, without a GPU) and their pairwise differences."""
    cpu_env = {"CUDA_VISIBLE_DEVICES": ""}
    rollouts = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "rollouts.pkl")
    arms: dict[str, dict] = {}
    for device in ("cpu", "cuda") if gpu else ("cpu",):
        for dtype in ("fp32", "bf16"):
            extra = ["--smoke"] if smoke else []
            arms[f"{device}_{dtype}"] = _run_section(["numerics", dtype, rollouts, *extra],
                                                     cpu_env if device == "cpu" else None, 600)
    pairs = [("cpu_fp32", "cuda_fp32"), ("cpu_bf16", "cuda_bf16"), ("cuda_fp32", "cuda_bf16"), ("cpu_fp32", "cpu_bf16")]
    return {"arms": {k: {kk: v for kk, v in a.items() if not kk.endswith("logprobs")} for k, a in arms.items()},
            "compare": {f"{x}_vs_{y}": compare(arms[x], arms[y]) for x, y in pairs
                        if arms.get(x, {}).get("ok") and arms.get(y, {}).get("ok")}}


def section_main(argv: list[str]) -> None:
    from gpu_decode import decode, decode_attention

    name, rest = argv[0], argv[1:]
    smoke = "--smoke" in rest
    rest = [a for a in rest if a != "--smoke"]
    runners = {"environment": environment, "peaks": lambda: peaks(smoke),
               "numerics": lambda: _numerics_arm(rest[0], rest[1], smoke),
               "rl_step": lambda: _rl_step_arm(int(rest[0]), smoke),
               "decode_attention": lambda: decode_attention(smoke), "decode": lambda: decode(smoke),
               "moe": lambda: moe(int(rest[0]), smoke)}
    if name not in runners:
        raise SystemExit(f"unknown section {name!r}")
    out = runners[name]()
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--section":
        section_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_check_<card>.json)")
    ap.add_argument("--cpu-smoke", action="store_true", help="every section at toy size, on the CPU")
    ap.add_argument("--steps", type=int, default=3, help="trainer steps of rl_step (the first is not measured)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    a = ap.parse_args()
    import torch

    card = (torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.cpu_smoke else "cpu")
    out = a.out or str(REPO / "bench" / "results" / f"gpu_check_{card.lower().replace(' ', '_')}.json")
    result = run_all(out, a.cpu_smoke, a.steps, tuple(a.sections.split(",")))
    summary = {k: v for k, v in result.items() if k in ("environment", "peaks", "derived", "decode_attention", "moe")}
    if "numerics" in result:
        summary["numerics"] = result["numerics"]["compare"] or result["numerics"]["arms"]
    if "rl_step" in result:
        summary["rl_step"] = {k: v for k, v in result["rl_step"].items() if k != "overrides"}
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
