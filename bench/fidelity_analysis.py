"""Analysis of bench/exgrpo_vs_grpo.py's runs: learning-rate choice on validation, test numbers with 95% CIs,
trajectories to a validation threshold, the logged curves (entropy, replay share, IS weights, bucket occupancy).

95% CI of a mean over n seeds: mean +- t_{0.975, n-1} * s / sqrt(n) (s the sample std, ddof=1).
Generated trajectories of a step: the run's `generation/trajectories` (every run records it now); records from before
it: B*K - (replayed questions) (a replayed question's K-th member is stored; those runs displaced, never appended).
"""

from __future__ import annotations

import json
import math
import os
import statistics

# Student t 0.975 quantiles for df = 1..30 (standard table); df > 30 uses the normal 1.96.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
TEST_KEYS = ("greedy", "avg@8_T0.6", "avg@8_T1")
CURVES = ("val", "entropy/mean", "replay/token_fraction", "replay/is_weight_mean", "replay/is_weight_max",
          "replay/shaped_weight_mean", "reward/fresh_mean")


# The paper's Qwen2.5-Math-7B in-distribution averages (Tab. 6 / Tab. 3).
PAPER_ID_AVG = {"exgrpo": 48.3, "no_question_selection": 46.7, "random_trajectory": 46.3,
                "highest_entropy_trajectory": 46.0, "no_policy_shaping": 41.2, "no_is_correction": 47.1,
                "rho_0.25": 46.4, "rho_0.75": 44.8, "sigma_0.5": 46.2, "sigma_1.5": 46.2, "mu_0.25": 46.3}
# Paper Tab. 5, Llama-3.1-8B base (ID avg / OOD avg): start 3.7 / 1.3, on-policy 3.4 / 1.2, ExGRPO 6.1 / 30.8.
PAPER_WEAK_START = {"start": 3.7, "grpo": 3.4, "exgrpo": 6.1}
COLLAPSE_KEY = "avg@8_T0.6"  # a weak-start run collapses if it ends below its start on this test metric ...
COLLAPSE_TAIL = 0.1  # ... or its fresh reward is 0 over this last fraction of its steps


def run_dir(root: str, variant: str, lr: float, seed: int) -> str:
    return os.path.join(root, f"{variant}_lr{lr:g}_seed{seed}")


def load_run(path: str) -> dict | None:
    """Per-step records of a run (None if it has no metrics); `trajectories` = cumulative generated ones."""
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.logging.metrics import read_metrics

    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics + ".gz"):  # a committed record (exgrpo_vs_grpo.py keeps them compressed)
        metrics += ".gz"
    elif not os.path.isfile(metrics):
        return None
    cfg = load_config("config", config_dir=path)
    per_step = cfg.trainer.train_batch_size * cfg.rollout.n
    records = sorted((r for r in read_metrics(metrics) if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    out: dict = {"steps": [], "trajectories": [], "total_steps": cfg.trainer.total_steps, "rollouts_per_step": per_step}
    total = 0.0
    for r in records:
        recorded = r.get("generation/trajectories")
        total += float(recorded) if recorded is not None else per_step - float(r.get("experience/n_replayed", 0.0))
        out["steps"].append(r["step"])
        out["trajectories"].append(total)
        for key in CURVES[1:]:
            out.setdefault(key, []).append(float(r.get(key, 0.0)))
        buckets = {k: float(v) for k, v in r.items() if k.startswith("experience/bucket_")}
        out.setdefault("buckets", []).append(buckets)
        out.setdefault("time_step", []).append(float(r.get("time/step", 0.0)))
        val = next((float(v) for k, v in r.items() if k.startswith("val/") and v is not None), None)
        if val is not None:
            out.setdefault("val", []).append((r["step"], total, val))
    for name, key in (("test_eval.json", "test"), ("start_eval.json", "start")):  # start: the warm start's
        if os.path.isfile(os.path.join(path, name)):
            with open(os.path.join(path, name)) as fh:
                out[key] = json.load(fh)
    return out


def ci95(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "ci95": None, "n": 0}
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return {"mean": mean, "ci95": None, "n": 1}
    df = len(vals) - 1
    half = (T975[df - 1] if df <= len(T975) else 1.96) * statistics.stdev(vals) / math.sqrt(len(vals))
    return {"mean": mean, "ci95": half, "n": len(vals)}


def final_val(run: dict | None) -> float | None:
    """Final validation accuracy of a finished run (the last val point at total_steps), else None."""
    if not run or not run.get("val") or run["steps"][-1] < run["total_steps"]:
        return None
    return run["val"][-1][2]


def best_learning_rates(root: str, arms: list[str], lrs: list[float], seeds: list[int]) -> dict[str, dict | None]:
    """Per arm, the swept rate with the highest mean final validation accuracy over `seeds` (all finished), and
    whether it is interior to the grid (neither its smallest nor its largest rate)."""
    return {arm: choose_rate(sweep_scores(root, arm, lrs, seeds), lrs) for arm in arms}


def choose_rate(scores: dict[float, float], lrs: list[float]) -> dict | None:
    """The best-scoring rate once every rate of the grid has a score, and whether it is interior to the grid
    (neither end: a choice at an end means the optimum was not located, so the grid must be extended)."""
    if len(scores) < len(lrs):
        return None
    best = max(scores, key=scores.__getitem__)
    return {"lr": best, "val_by_lr": scores, "interior": min(lrs) < best < max(lrs)}


def sweep_scores(root: str, arm: str, lrs: list[float], seeds: list[int]) -> dict[float, float]:
    """Mean final validation accuracy per swept rate whose runs on every seed have finished."""
    scores = {}
    for lr in lrs:
        vals = [final_val(load_run(run_dir(root, arm, lr, s))) for s in seeds]
        if all(v is not None for v in vals):
            scores[lr] = statistics.fmean(v for v in vals if v is not None)
    return scores


def collapsed(run: dict) -> bool:
    """Ends below its warm start on the test split, or fresh reward 0 over the last COLLAPSE_TAIL of its steps."""
    tail = run["reward/fresh_mean"][-max(1, int(len(run["steps"]) * COLLAPSE_TAIL)):]
    below = "start" in run and run["test"][COLLAPSE_KEY] < run["start"][COLLAPSE_KEY]
    return below or max(tail) == 0.0


def weak_start_verdict(root: str, best: dict, seeds: list[int], threshold: float) -> dict:
    """Per arm at its chosen rate: start and final test accuracy, final minus start (95% CI), collapsed runs."""
    out: dict = {}
    for arm, choice in best.items():
        if not choice:
            continue
        runs = [r for r in _runs_by_seed(root, f"weak_{arm}", choice["lr"], seeds).values()
                if "test" in r and "start" in r]
        if runs:
            out[arm] = {"lr": choice["lr"], **summarize(runs, threshold),
                        "start": {k: ci95([r["start"][k] for r in runs]) for k in TEST_KEYS},
                        "final_minus_start": {k: ci95([r["test"][k] - r["start"][k] for r in runs]) for k in TEST_KEYS},
                        "collapsed": f"{sum(collapsed(r) for r in runs)}/{len(runs)}"}
    return out


def median_step_seconds(root: str) -> float | None:
    times = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            run = load_run(os.path.join(root, name)) if name != "sft_cache" else None
            if run and run["time_step"]:
                times.append(statistics.median(run["time_step"]))
    return statistics.median(times) if times else None


def trajectories_to_threshold(run: dict, threshold: float) -> float | None:
    return next((traj for _, traj, v in run.get("val", []) if v >= threshold), None)


def summarize(runs: list[dict], threshold: float) -> dict:
    out = {key: ci95([r["test"].get(key) for r in runs if "test" in r]) for key in TEST_KEYS}
    out["final_val"] = ci95([final_val(r) for r in runs])
    reached = [trajectories_to_threshold(r, threshold) for r in runs]
    out["trajectories_to_threshold"] = {**ci95([x for x in reached if x is not None]),
                                        "reached": f"{sum(x is not None for x in reached)}/{len(runs)}"}
    out["generated_trajectories"] = ci95([r["trajectories"][-1] for r in runs])
    out["entropy_last10"] = ci95([statistics.fmean(r["entropy/mean"][-10:]) for r in runs])
    return out


def paired_difference(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Mean and 95% CI over the seeds both have of (a - b) per test key and final validation accuracy. A seed's
    runs share their warm start, so the seed-to-seed spread of the start (larger than the effect) cancels."""
    seeds = sorted(s for s in set(a) & set(b) if "test" in a[s] and "test" in b[s])
    out = {key: ci95([a[s]["test"][key] - b[s]["test"][key] for s in seeds]) for key in TEST_KEYS}
    vals = [(final_val(a[s]), final_val(b[s])) for s in seeds]
    out["final_val"] = ci95([x - y for x, y in vals if x is not None and y is not None])
    out["seeds"] = seeds
    return out


def _runs_by_seed(root: str, variant: str, lr: float, seeds: list[int]) -> dict[int, dict]:
    return {s: r for s in seeds if (r := load_run(run_dir(root, variant, lr, s)))}


def analyse(root: str, arms: dict, ablations: dict, best: dict, seeds: list[int], ablation_seeds: list[int],
            threshold: float, lrs: list[float], stability_factor: float, png: str,
            diagnoses: dict | None = None, sweep_seeds: list[int] | None = None) -> dict:
    result: dict = {"protocol_note": __doc__.strip().splitlines()[0], "threshold_val_acc": threshold,
                    "best_lr": best, "arms": {}, "paired": {}, "ablations": {}, "stability": {}, "diagnosis": {}}
    curves: dict[str, list[dict]] = {}
    by_seed: dict[str, dict[int, dict]] = {}
    high = max(lrs) * stability_factor
    for arm in arms:
        if best.get(arm):
            by_seed[arm] = _runs_by_seed(root, arm, best[arm]["lr"], seeds)
            runs = list(by_seed[arm].values())
            result["arms"][arm] = {"lr": best[arm]["lr"], **summarize(runs, threshold)}
            curves[arm] = runs
        runs = list(_runs_by_seed(root, arm, high, ablation_seeds).values())
        if runs:
            result["stability"][arm] = {"lr": high, **summarize(runs, threshold)}
    if "exgrpo" in by_seed and "grpo" in by_seed:
        result["paired"]["exgrpo - grpo"] = paired_difference(by_seed["exgrpo"], by_seed["grpo"])
    if best.get("exgrpo"):
        for name in ablations:
            runs_by_seed = _runs_by_seed(root, name, best["exgrpo"]["lr"], ablation_seeds)
            if runs_by_seed:
                result["ablations"][name] = {**summarize(list(runs_by_seed.values()), threshold),
                                             "minus_full": paired_difference(runs_by_seed, by_seed["exgrpo"])}
                if "grpo" in by_seed:  # on-policy GRPO at its own rate, the same seeds' warm starts
                    result["ablations"][name]["minus_grpo"] = paired_difference(runs_by_seed, by_seed["grpo"])
    for name in diagnoses or {}:
        for lr in (best["grpo"]["lr"] if best.get("grpo") else None, high):
            runs_by_seed = _runs_by_seed(root, name, lr, ablation_seeds) if lr else {}
            if runs_by_seed:
                row = {"lr": lr, **summarize(list(runs_by_seed.values()), threshold)}
                for arm in arms:
                    row[f"minus_{arm}"] = paired_difference(runs_by_seed, _runs_by_seed(root, arm, lr, ablation_seeds))
                result["diagnosis"][f"{name} ({lr:g})"] = row
    result["weak_start"] = weak_start_verdict(root, best, seeds, threshold)
    result["sweep"] = {arm: {f"{lr:g}": v for lr, v in sweep_scores(root, arm, lrs, sweep_seeds or seeds).items()}
                       for arm in arms}  # mean final validation per finished rate (also while the sweep runs)
    if curves:
        plot(curves, png, paired=(by_seed["exgrpo"], by_seed["grpo"]) if result["paired"] else None)
        result["png"] = os.path.relpath(png, os.path.dirname(os.path.dirname(png)))
    return result


def _band(runs: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    """x (mean generated trajectories), mean and 95% CI half-width per step over runs."""
    if key == "val":
        series = [[v for _, _, v in r.get("val", [])] for r in runs]
        xs = [[t for _, t, _ in r.get("val", [])] for r in runs]
    else:
        series = [r[key] for r in runs]
        xs = [r["trajectories"] for r in runs]
    n = min(len(s) for s in series)
    x = [statistics.fmean(xx[i] for xx in xs) for i in range(n)]
    cis = [ci95([s[i] for s in series]) for i in range(n)]
    return x, [c["mean"] for c in cis], [c["ci95"] or 0.0 for c in cis]


def paired_val_curve(a: dict[int, dict], b: dict[int, dict]) -> tuple[list[int], list[float], list[float]]:
    """Validation steps, mean and 95% CI half-width over the common seeds of val(a) - val(b) at each step."""
    seeds = sorted(set(a) & set(b))
    val_a = [{step: v for step, _, v in a[s].get("val", [])} for s in seeds]
    val_b = [{step: v for step, _, v in b[s].get("val", [])} for s in seeds]
    steps = sorted(set.intersection(*(set(d) for d in val_a + val_b))) if seeds else []
    cis = [ci95([va[t] - vb[t] for va, vb in zip(val_a, val_b, strict=True)]) for t in steps]
    return steps, [c["mean"] for c in cis], [c["ci95"] or 0.0 for c in cis]


def plot(curves: dict[str, list[dict]], path: str, paired: tuple[dict, dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ("val", "paired", "entropy/mean", "replay/token_fraction", "replay/is_weight_mean", "buckets")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, key in zip(axes, panels, strict=True):
        if key == "paired":
            if paired:
                steps, mean, half = paired_val_curve(*paired)
                per_step = next(iter(paired[0].values()))["rollouts_per_step"]
                budget = [t * per_step for t in steps]
                ax.plot(budget, mean, marker="o", color="C2")
                ax.fill_between(budget, [m - h for m, h in zip(mean, half, strict=True)],
                                [m + h for m, h in zip(mean, half, strict=True)], alpha=0.25, color="C2")
                ax.axhline(0.0, color="k", lw=0.8)
            ax.set_title("validation: ExGRPO - GRPO (paired over seeds)")
            ax.set_xlabel("rollout budget (steps x B x K)")
            continue
        for arm, runs in curves.items():
            if key == "buckets":
                if arm != "exgrpo":
                    continue
                last = runs[0]["buckets"]
                for k in sorted({b for step in last for b in step}, key=lambda s: int(s.split("_")[-1])):
                    ax.plot(runs[0]["trajectories"], [step.get(k, 0.0) for step in last], label=k.split("/")[-1])
                continue
            if not all(r.get(key) for r in runs):
                continue
            x, mean, half = _band(runs, key)
            ax.plot(x, mean, label=f"{arm} (n={len(runs)})", marker="o" if key == "val" else None)
            ax.fill_between(x, [m - h for m, h in zip(mean, half, strict=True)],
                            [m + h for m, h in zip(mean, half, strict=True)], alpha=0.25)
        ax.set_title("validation accuracy (T=0.6)" if key == "val" else
                     "pool buckets (exgrpo, first seed)" if key == "buckets" else key)
        ax.set_xlabel("generated trajectories")
        ax.legend(fontsize="small")
    fig.suptitle("ExGRPO vs on-policy GRPO, each at its best learning rate (mean, 95% CI over seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _fmt(ms: dict) -> str:
    if not ms or ms.get("mean") is None:
        return "n/a"
    return f"{ms['mean']:.3f}" + (f" +- {ms['ci95']:.3f}" if ms.get("ci95") is not None else "") + f" (n={ms['n']})"


def print_tables(summary: dict) -> None:
    cols = ("greedy", "avg@8_T0.6", "avg@8_T1", "final_val", "trajectories_to_threshold")
    print(f"{'variant':30s}" + "".join(f"{c:>28s}" for c in cols))
    for section in ("arms", "ablations", "stability"):
        for name, row in summary.get(section, {}).items():
            print(f"{(name if section != 'stability' else name + ' (high lr)'):30s}"
                  + "".join(f"{_fmt(row.get(c, {})):>28s}" for c in cols))
    print("paired differences (same seeds, same warm start):")
    rows = dict(summary.get("paired", {}))
    rows.update({f"{name} - exgrpo": row["minus_full"] for name, row in summary.get("ablations", {}).items()})
    for name, row in rows.items():
        print(f"{name:30s}" + "".join(f"{_fmt(row.get(c, {})):>28s}" for c in cols[:4]))


def _md(ms: dict | None, signed: bool = False, scale: float = 100.0) -> str:
    """A mean ± 95% CI, x `scale` (100: a fraction in points; 1: a count); `signed` for differences."""
    if not ms or ms.get("mean") is None:
        return "n/a"
    ci = f" ± {ms['ci95'] * scale:.1f}" if ms.get("ci95") is not None else ""
    return f"{ms['mean'] * scale:{'+' if signed else ''}.1f}{ci}"


def markdown_tables(summary: dict) -> str:
    """README tables (accuracy in points, mean ± 95% CI over seeds): the arms, their paired difference, the
    ablations beside the paper's numbers, the high-learning-rate runs."""
    keys = ("greedy", "avg@8_T0.6", "avg@8_T1", "final_val")
    lines_sweep = []
    if summary.get("sweep"):
        grid = summary.get("lrs") or sorted({float(lr) for v in summary["sweep"].values() for lr in v})
        lines_sweep = ["| validation (final, T=0.6) by rate | " + " | ".join(f"{lr:g}" for lr in grid)
                       + " | chosen | interior |", "|---" * (len(grid) + 3) + "|"]
        for arm, by_lr in summary["sweep"].items():
            best = (summary.get("best_lr") or {}).get(arm) or {}
            cells = " | ".join(f"{by_lr[f'{lr:g}'] * 100:.1f}" if f"{lr:g}" in by_lr else "..." for lr in grid)
            lines_sweep.append(f"| {arm} | {cells} | {best.get('lr', 'pending')} | {best.get('interior', 'pending')} |")
        lines_sweep.append("")
    head = "| greedy | avg@8 T=0.6 | avg@8 T=1.0 | val (final) |"
    rule = "|---|---" + "|---" * len(keys) + "|"
    lines = [*lines_sweep, "| arm (lr) | seeds " + head, rule]
    for arm, row in summary.get("arms", {}).items():
        cells = " | ".join(_md(row[k]) for k in keys)
        lines.append(f"| {arm} ({row['lr']:g}) | {row['greedy']['n']} | {cells} |")
    for name, row in summary.get("paired", {}).items():
        cells = " | ".join(_md(row[k], signed=True) for k in keys)
        lines.append(f"| **{name}** (paired) | {len(row['seeds'])} | {cells} |")
    if summary.get("ablations"):
        lines += ["", "| variant | seeds | greedy | minus full ExGRPO (paired) | minus GRPO (paired) | avg@8 T=1.0 "
                  "| minus full (paired) | paper ID avg (minus full) |", "|---|---|---|---|---|---|---|---|"]
        for name, row in summary["ablations"].items():
            d, paper = row["minus_full"], PAPER_ID_AVG.get(name)
            ref = f"{paper:.1f} ({paper - PAPER_ID_AVG['exgrpo']:+.1f})" if paper is not None else "n/a"
            vs_grpo = _md(row["minus_grpo"]["greedy"], signed=True) if "minus_grpo" in row else "n/a"
            lines.append(f"| {name} | {row['greedy']['n']} | {_md(row['greedy'])} | {_md(d['greedy'], signed=True)} "
                         f"| {vs_grpo} | {_md(row['avg@8_T1'])} | {_md(d['avg@8_T1'], signed=True)} | {ref} |")
    if summary.get("diagnosis"):
        lines += ["", "| diagnosis (lr) | seeds | greedy | minus ExGRPO, same lr (paired) "
                  "| minus GRPO, same lr (paired) | avg@8 T=1.0 |", "|---|---|---|---|---|---|"]
        for name, row in summary["diagnosis"].items():
            lines.append(f"| {name} | {row['greedy']['n']} | {_md(row['greedy'])} | "
                         f"{_md(row['minus_exgrpo']['greedy'], signed=True)} | "
                         f"{_md(row['minus_grpo']['greedy'], signed=True)} | {_md(row['avg@8_T1'])} |")
    if summary.get("weak_start"):
        lines += ["", "| weak start (lr) | seeds | start avg@8 T=0.6 | final avg@8 T=0.6 | final - start (paired) "
                  "| greedy final - start | collapsed |", "|---|---|---|---|---|---|---|"]
        for arm, row in summary["weak_start"].items():
            d = row["final_minus_start"]
            lines.append(f"| {arm} ({row['lr']:g}) | {row['greedy']['n']} | {_md(row['start']['avg@8_T0.6'])} | "
                         f"{_md(row['avg@8_T0.6'])} | {_md(d['avg@8_T0.6'], signed=True)} | "
                         f"{_md(d['greedy'], signed=True)} | {row['collapsed']} |")
    if summary.get("stability"):
        lines += ["", "| high learning rate | seeds " + head, rule]
        for arm, row in summary["stability"].items():
            cells = " | ".join(_md(row[k]) for k in keys)
            lines.append(f"| {arm} ({row['lr']:g}) | {row['greedy']['n']} | {cells} |")
    return "\n".join(lines)
