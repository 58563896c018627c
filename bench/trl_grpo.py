"""TRL's GRPOTrainer side by side with ours, in one run: the same model (SmolLM2-135M-Instruct, `make smollm2`),
task (the shipped word problems, the tokenizer's chat template over the question alone, as `chat_direct`), reward
(our Math-Verify grader, whole response graded) and shape (8 prompts x 4 completions, 64 new tokens, T=0.6, lr 2e-6,
one update per step), TRL in fp32 and with bf16 autocast (its best CPU precision), ours in fp32 and bf16
(`model.params_dtype`), one arm after another in ARMS' order, alternating the frameworks.

    make venv-trl smollm2 && .venv-trl/bin/python bench/trl_grpo.py [--steps 5] [--arms trl_fp32 ours_fp32 ...]

Ours: `exgrpo_megatron.train --config-name smollm2_word_problems` (the preset users run: ExGRPO, one update per step;
replay starts once the batch pass rate reaches 10%, so a short run is mostly on-policy) under `--ours-python` (the
project's .venv), from the converted checkpoint bench/real_model_e2e.py builds; its `time/step` and `reward/mean`
per step. Both frameworks train and generate with all the machine's cores (ours: OMP_NUM_THREADS = the core count
for generation, `trainer.train_threads=0` for the policy's passes).

CPU settings: use_cpu=True, gradient_checkpointing=False; loss_type="dr_grpo", scale_rewards="none" and beta=0
(no reference model) as our objective; GRPOTrainer counts completions in per_device_train_batch_size (32 =
8 prompts x 4). Per step: the wall time between TRL's step-end callbacks (generation, reward and the update,
like our `time/step`) and the mean reward. Step 1 (warm-up) is left out of the means. Writes
bench/results/trl_grpo.json; compare with bench/results/real_model_e2e.json (the same shape through our trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results", "trl_grpo.json")
MODEL_DIR = os.path.join(REPO, ".cache", "smollm2-135m-instruct")
ARMS = ("ours_fp32", "trl_fp32", "ours_bf16", "trl_bf16")  # run in this order
TRAIN = os.path.join(REPO, "data", "word_problems", "train.jsonl")


def math_verify_reward(completions, ground_truth, **_) -> list[float]:
    """Our training reward: Math-Verify on the whole response (require_think=false, as the preset)."""
    from exgrpo_megatron.reward.scoring import score_response

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score_response(t, g, False, 5) for t, g in zip(texts, ground_truth, strict=True)]


def dataset():
    from datasets import Dataset

    with open(TRAIN) as f:
        rows = [json.loads(line) for line in f]
    return Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                              for r in rows])


def arm_record(precision: str, times: list[float], log_history: list[dict], complete: bool) -> dict:
    """The arm's JSON: per-step wall seconds and rewards, their means (step 1 left out of the time mean)."""
    rewards = [h["reward"] for h in log_history if "reward" in h]
    measured = times[1:] or times
    return {"precision": precision, "complete": complete, "step_s": times, "reward": rewards,
            "mean_step_s": statistics.fmean(measured) if measured else None,
            "mean_reward": statistics.fmean(rewards) if rewards else None}


def write(result: dict) -> None:
    result["load_average_end"] = os.getloadavg()
    with open(RESULTS_JSON, "w") as f:
        json.dump(result, f, indent=1)


def run_trl_arm(precision: str, steps: int, out_dir: str, result: dict) -> dict:
    """Train one arm; after every step the partial arm is written (a slow box keeps what finished)."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, **kw):
            result["arms"][f"trl_{precision}"] = arm_record(precision, times, state.log_history, False)
            write(result)

    torch.manual_seed(1234)
    config = GRPOConfig(output_dir=out_dir, use_cpu=True, gradient_checkpointing=False, bf16=precision == "bf16",
                        loss_type="dr_grpo", scale_rewards="none", beta=0.0, learning_rate=2e-6, max_steps=steps,
                        per_device_train_batch_size=32, num_generations=4, max_completion_length=64,
                        temperature=0.6, logging_steps=1, save_strategy="no", report_to=[], seed=1234,
                        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=MODEL_DIR, reward_funcs=math_verify_reward, args=config, train_dataset=dataset(),
                          callbacks=[StepTimer()])
    trainer.train()
    return arm_record(precision, times, trainer.state.log_history, True)


def run_ours_arm(precision: str, steps: int, root: str, python: str) -> dict:
    """Our trainer on the same shape (a finished run is reused: its metrics are the record)."""
    sys.path.insert(0, HERE)
    from real_model_e2e import load_steps, run

    ckpt = os.path.join(root, "converted")  # real_model_e2e.prepare's, built in our environment (cached)
    run(["-c", f"import sys; sys.path.insert(0, {HERE!r}); import real_model_e2e as e; e.prepare({root!r})"],
        os.path.join(root, "prepare.log"), python)
    run_dir = os.path.join(root, f"ours_{precision}")
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        run(["-m", "exgrpo_megatron.train", "--config-name", "smollm2_word_problems", f"model.params_dtype={precision}",
             f"checkpoint.init_from={ckpt}", f"logging.run_dir={run_dir}", f"trainer.total_steps={steps}",
             f"checkpoint.save_every={steps}", "checkpoint.resume=auto", "trainer.train_threads=0"],
            os.path.join(root, f"ours_{precision}.log"), python, threads=os.cpu_count() or 1)
    s = load_steps(run_dir)
    times = s["step_s"]
    measured = times[1:] or times
    return {"precision": precision, "complete": len(times) == steps, "step_s": times, "reward": s["reward"],
            "generate_s": s["generate_s"], "train_s": s["train_s"], "old_logprobs_s": s["old_logprobs_s"],
            "mean_step_s": statistics.fmean(measured) if measured else None,
            "mean_reward": statistics.fmean(s["reward"]) if s["reward"] else None}


def ratios(arms: dict) -> dict:
    """Step-time ratios between the arms that finished: TRL's / ours in each precision and best against best."""
    t = {k: a["mean_step_s"] for k, a in arms.items() if a.get("complete") and a.get("mean_step_s")}
    out = {f"trl_{p}_over_ours_{p}": t[f"trl_{p}"] / t[f"ours_{p}"] for p in ("fp32", "bf16")
           if f"trl_{p}" in t and f"ours_{p}" in t}
    trl = [v for k, v in t.items() if k.startswith("trl_")]
    ours = [v for k, v in t.items() if k.startswith("ours_")]
    if trl and ours:
        out["trl_best_over_ours_best"] = min(trl) / min(ours)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--root", default=os.path.join(REPO, "runs", "bench_trl_grpo"))
    ap.add_argument("--ours-python", default=os.path.join(REPO, ".venv", "bin", "python"))
    args = ap.parse_args()
    import torch
    import trl

    sys.path.insert(0, HERE)
    from machine_peaks import measure_peaks

    os.makedirs(args.root, exist_ok=True)
    result = {"command": " ".join(["bench/trl_grpo.py", *sys.argv[1:]]), "trl": trl.__version__,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "load_average_start": os.getloadavg(), "machine_peaks": measure_peaks(), "arms": {}}
    for arm in args.arms:
        framework, precision = arm.split("_")
        if framework == "trl":
            record = run_trl_arm(precision, args.steps, os.path.join(args.root, arm), result)
        else:
            record = run_ours_arm(precision, args.steps, args.root, args.ours_python)
        result["arms"][arm] = {**record, "load_average_after": os.getloadavg()}
        result["ratios"] = ratios(result["arms"])
        print(f"{arm}: {record['mean_step_s']:.1f} s/step, reward {record['mean_reward']}", flush=True)
        write(result)
    result["machine_peaks_end"] = measure_peaks()
    write(result)
    print(json.dumps(result["ratios"], indent=1))
    print(f"wrote {RESULTS_JSON}")


if __name__ == "__main__":
    main()
