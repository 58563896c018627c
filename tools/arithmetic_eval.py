"""Per-question success rates of a policy on a split of the built-in arithmetic task.

Two uses (one process, one rank; run from the repo root with PYTHONPATH=$PWD):

  difficulty  -- the cached supervised warm start of a preset (trained first if missing), K samples per question
                 at rollout.temperature over the first N TRAINING questions: the histogram of k = #correct of K,
                 i.e. the correctness buckets the experience pool would see at the start of RL (paper §3.2: a
                 real math set spreads over all buckets). Writes JSON + PNG.
      python tools/arithmetic_eval.py difficulty --config-name fidelity_cpu --questions 320 -k 8 \
          --out bench/results/fidelity_difficulty
  test        -- a finished run's newest checkpoint (or --weights, e.g. its warm start: the step-0 baseline) on
                 the TEST split (data.num_test_examples; the run's own resolved config): greedy accuracy and avg@k
                 at each --temperatures. Writes JSON. `--split train --questions N`: the first N TRAINING
                 questions instead (the questions the run trained and replayed on), to compare with the test
                 split (a larger train - test gap in one arm = overfitting the questions it saw). `--counts`:
                 also each question's #correct of k at each temperature (the pass@k probe per question: which
                 hard questions a run taught, e.g. `--split train --temperatures 1.0 --counts`).
      python tools/arithmetic_eval.py test --run-dir runs/x --out runs/x/test_eval.json

avg@k = (1/Q) sum_q (1/k) sum_j c_qj (as exgrpo_megatron.evaluate); greedy = temperature 0, one sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np


def _setup(cfg):
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.training.components import build_components

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    layout = init_distributed(seed=cfg.seed)
    return build_components(cfg, layout, build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length))


def correct_counts(c, dataset, qids: list[int], k: int, temperature: float, seed: int) -> list[int]:
    """#correct of k samples for each question (batched through the rollout engine and the grader pool)."""
    from exgrpo_megatron.data.step_plan import QuestionGroup
    from exgrpo_megatron.rollout.types import SamplingParams

    cfg = c.cfg
    groups = [QuestionGroup(q, dataset[q].prompt_ids, dataset[q].answer) for q in qids]
    params = SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=temperature,
                            top_p=1.0, stop_strings=list(cfg.rollout.stop), seed=seed)
    generated = c.rollout.generate(groups, k, params)
    samples = generated.samples
    flat = iter(generated.grading.result().rewards)
    return [int(sum(next(flat) == 1.0 for _ in s)) for s in samples]


def bucket_histogram(counts: list[int], k: int) -> list[int]:
    """Number of questions with j correct of k, j = 0..k."""
    hist = Counter(counts)
    return [int(hist.get(j, 0)) for j in range(k + 1)]


def difficulty(args: argparse.Namespace) -> dict:
    from exgrpo_megatron.checkpoint import load_model_weights
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.policy.warm_start import warm_start_weights

    cfg = load_config(args.config_name, args.override)
    c = _setup(cfg)
    load_model_weights(warm_start_weights(cfg, c.tokenizer), c.policy.modules, model_config=cfg.model)
    qids = c.train_data.qids()[: args.questions]
    counts = correct_counts(c, c.train_data, qids, args.k, cfg.rollout.temperature, seed=cfg.seed)
    tiers = [c.train_data[q].data_source for q in qids]
    per_tier = {t: bucket_histogram([n for n, s in zip(counts, tiers, strict=True) if s == t], args.k)
                for t in sorted(set(tiers))}
    hist = bucket_histogram(counts, args.k)
    middle = sum(hist[j] for j in range(2, args.k - 1))  # buckets 2..K-2: the Gaussian's bulk (p ~ .94 of it)
    return {
        "config_name": args.config_name, "overrides": args.override, "seed": cfg.seed, "k": args.k,
        "temperature": cfg.rollout.temperature, "questions": len(qids), "tiers": list(cfg.data.arithmetic_tiers),
        "warm_start_steps": cfg.trainer.sft_warm_start_steps,
        "bucket_histogram": hist, "bucket_histogram_per_tier": per_tier,
        "fraction_all_wrong": hist[0] / len(qids), "fraction_all_right": hist[-1] / len(qids),
        "fraction_buckets_1_to_K-1": sum(hist[1:-1]) / len(qids), "fraction_buckets_2_to_K-2": middle / len(qids),
        "mean_success_rate": float(np.mean(counts)) / args.k,
    }


def plot_histogram(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = result["k"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(k + 1)
    for tier, hist in result["bucket_histogram_per_tier"].items():
        ax.bar(range(k + 1), hist, bottom=bottom, label=tier.split("/")[-1])
        bottom += np.asarray(hist)
    ax.set_xlabel(f"correct of K={k} samples (T={result['temperature']})")
    ax.set_ylabel("questions")
    ax.set_title(f"{result['config_name']}: warm-start success per question ({result['questions']} train questions)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def test_split(args: argparse.Namespace) -> dict:
    from exgrpo_megatron.checkpoint import load_model_weights
    from exgrpo_megatron.checkpoint.layout import find_latest
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.data.synthetic import arithmetic_split_datasets

    cfg = load_config("config", [f"logging.run_dir={args.run_dir}"], config_dir=args.run_dir)
    c = _setup(cfg)
    ckpt = args.weights or find_latest(args.run_dir)
    if ckpt is None:
        raise SystemExit(f"{args.run_dir}: no complete checkpoint")
    load_model_weights(ckpt, c.policy.modules, model_config=cfg.model)
    test = arithmetic_split_datasets(cfg.data, cfg.seed, c.tokenizer).get(args.split)
    if test is None:
        raise SystemExit(f"{args.run_dir}: data.num_test_examples is 0 in its config")
    qids = test.qids()[:args.questions] if args.questions else test.qids()
    out: dict = {"run_dir": args.run_dir, "checkpoint": str(ckpt), "split": args.split, "questions": len(qids)}
    out["greedy"] = float(np.mean(correct_counts(c, test, qids, 1, 0.0, seed=cfg.seed)))
    for temperature in args.temperatures:
        counts = correct_counts(c, test, qids, args.k, temperature, seed=cfg.seed + 1)
        out[f"avg@{args.k}_T{temperature:g}"] = float(np.mean(counts)) / args.k
        if args.counts:  # in the split's question order (the first `questions` of it)
            out[f"correct_of_{args.k}_T{temperature:g}"] = counts
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("difficulty")
    d.add_argument("--config-name", default="fidelity_cpu")
    d.add_argument("--questions", type=int, default=320)
    d.add_argument("-k", type=int, default=8)
    d.add_argument("--out", default="bench/results/fidelity_difficulty", help="writes <out>.json and <out>.png")
    d.add_argument("override", nargs="*", help="hydra overrides, e.g. trainer.sft_warm_start_steps=60")
    t = sub.add_parser("test")
    t.add_argument("--run-dir", required=True)
    t.add_argument("-k", type=int, default=8)
    t.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    t.add_argument("--out", required=True, help="JSON file")
    t.add_argument("--split", choices=("test", "train"), default="test")
    t.add_argument("--questions", type=int, default=0, help="only the split's first N questions (0: all)")
    t.add_argument("--counts", action="store_true", help="also each question's #correct of k per temperature")
    t.add_argument("--weights", default=None,
                   help="evaluate these weights (e.g. the run's cached warm start) instead of its newest checkpoint")
    args = p.parse_args(argv)
    if args.what == "difficulty":
        result = difficulty(args)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        plot_histogram(result, args.out + ".png")
        path = args.out + ".json"
    else:
        result = test_split(args)
        path = args.out
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(path + ".tmp", path)
    print(json.dumps(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
