"""Analysis of bench/exgrpo_vs_grpo.py's `recipes` phase: each replay recipe against on-policy GRPO per step and per
generated trajectory, from the committed records only.

* baselines: GRPO and ExGRPO (the paper's recipe) rerun at the recipes' code version (`<arm>_same_code`) where those
  runs exist, else the arms' records from their earlier code version (`baseline` says which);
* per step (equal steps): the test numbers at the end of training (greedy, avg@8 at T = 0.6 and 1.0) and the final
  validation accuracy, paired by seed against GRPO (and against ExGRPO's paper recipe, and, for an append recipe,
  against the GRPO arm that generates as much per step: `matched`);
* per generated trajectory (equal generation): validation accuracy (avg@1, T = 0.6) of both runs of a seed pair at
  the same number of generated trajectories -- the smaller of the two runs' totals, each run's validation curve
  interpolated linearly in generated trajectories there -- paired by seed; and the generated trajectories to reach the
  validation threshold (paired over the seeds where both runs reach it);
* weak start: each recipe from the weak warm start, its final minus start on the test split and collapsed runs, and
  the same paired differences per step and per generated trajectory against weak GRPO and weak ExGRPO (same code).
Paired differences: mean and 95% CI over seeds (fidelity_analysis.ci95: t quantile, n - 1 degrees of freedom).
"""

from __future__ import annotations

import os
from typing import Any

import fidelity_analysis as fa

TEST_KEYS = fa.TEST_KEYS


def val_at(run: dict, budget: float) -> float | None:
    """Validation accuracy at `budget` generated trajectories, linear between the run's validation points; None
    before its first point or past its last."""
    points = [(traj, v) for _, traj, v in run.get("val", [])]
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t0 <= budget <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (budget - t0) / (t1 - t0)
    return points[0][1] if points and points[0][0] == budget else None


def per_trajectory(a: dict[int, dict], b: dict[int, dict], threshold: float) -> dict:
    """Paired over seeds: val(a) - val(b) at the seed pair's common generation budget (the smaller total), the budget,
    and the trajectories to the validation threshold of a minus b."""
    seeds = sorted(set(a) & set(b))
    diffs, budgets, to_threshold = [], [], []
    for s in seeds:
        budget = min(a[s]["trajectories"][-1], b[s]["trajectories"][-1])
        va, vb = val_at(a[s], budget), val_at(b[s], budget)
        if va is not None and vb is not None:
            diffs.append(va - vb)
            budgets.append(budget)
        ta, tb = fa.trajectories_to_threshold(a[s], threshold), fa.trajectories_to_threshold(b[s], threshold)
        if ta is not None and tb is not None:
            to_threshold.append(ta - tb)
    return {"val_at_equal_trajectories": fa.ci95(diffs), "budget": fa.ci95(budgets),
            "trajectories_to_threshold": {**fa.ci95(to_threshold), "both_reached": f"{len(to_threshold)}/{len(seeds)}"},
            "seeds": seeds}


def _runs(root: str, variant: str, lr: float, seeds: list[int]) -> dict[int, dict]:
    return {s: r for s, r in fa._runs_by_seed(root, variant, lr, seeds).items() if "test" in r}


def versus(runs: dict[int, dict], others: dict[str, dict[int, dict]], threshold: float) -> dict:
    """Paired differences of `runs` against each baseline that has runs: per step and per generated trajectory."""
    return {other: {"per_step": fa.paired_difference(runs, other_runs),
                    "per_trajectory": per_trajectory(runs, other_runs, threshold)}
            for other, other_runs in others.items() if other_runs}


def analyse_recipes(root: str, recipes: dict, weak: dict, matched: dict, best: dict, seeds: list[int],
                    threshold: float, png: str) -> dict:
    if not best.get("exgrpo") or not best.get("grpo"):
        return {}
    lr = {"exgrpo": best["exgrpo"]["lr"], "grpo": best["grpo"]["lr"]}
    base: dict[str, dict[int, dict]] = {}
    out: dict[str, Any] = {"per_recipe": {}, "weak_start": {}, "baseline": {}}
    for arm in ("exgrpo", "grpo", "weak_exgrpo", "weak_grpo"):
        rate = lr["exgrpo" if "exgrpo" in arm else "grpo"]
        same = _runs(root, f"{arm}_same_code", rate, seeds)
        base[arm] = same or _runs(root, arm, rate, seeds)
        out["baseline"][arm] = f"{arm}_same_code" if same else f"{arm} (recorded at an earlier code version)"
    out["baseline_versus"] = {arm: versus(base[arm], {other: base[other]}, threshold) for arm, other in
                              (("exgrpo", "grpo"), ("weak_exgrpo", "weak_grpo")) if base[arm]}
    curves: dict[str, dict[int, dict]] = {arm: runs for arm, runs in base.items() if runs}
    for name in (n for n in recipes if not n.endswith("_same_code")):
        runs = _runs(root, name, lr["grpo" if name.startswith("grpo") else "exgrpo"], seeds)
        if not runs:
            continue
        curves[name] = runs
        others = {"grpo": base["grpo"], "exgrpo": base["exgrpo"]}
        if name in matched:
            others["matched " + matched[name]] = _runs(root, matched[name], lr["grpo"], seeds)
        out["per_recipe"][name] = {**fa.summarize(list(runs.values()), threshold),
                                   "versus": versus(runs, others, threshold)}
    for name in (n for n in weak if not n.endswith("_same_code")):
        runs = {s: r for s, r in _runs(root, name, lr["exgrpo"], seeds).items() if "start" in r}
        if not runs:
            continue
        curves[name] = runs
        out["weak_start"][name] = {
            **fa.summarize(list(runs.values()), threshold),
            "final_minus_start": {k: fa.ci95([r["test"][k] - r["start"][k] for r in runs.values()])
                                  for k in TEST_KEYS},
            "collapsed": f"{sum(fa.collapsed(r) for r in runs.values())}/{len(runs)}",
            "versus": versus(runs, {"weak_grpo": base["weak_grpo"], "weak_exgrpo": base["weak_exgrpo"]}, threshold)}
    if len(curves) > 2:
        plot(curves, png)
        out["png"] = os.path.relpath(png, os.path.dirname(os.path.dirname(png)))
    return out


MIN_PLOT_SEEDS = 3  # a 95% band over 2 seeds (t = 12.7) dwarfs every other curve; such arms stay in the tables


def plot(curves: dict[str, dict[int, dict]], path: str) -> None:
    """Validation accuracy per step and per generated trajectory, and each arm minus on-policy GRPO paired by seed
    per step; the weak-start arms in a row of their own (against weak GRPO). Arms with fewer than MIN_PLOT_SEEDS
    seeds are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, {n: r for n, r in curves.items() if n.startswith("weak_") == weak and len(r) >= MIN_PLOT_SEEDS})
            for name, weak in (("grpo", False), ("weak_grpo", True))]
    rows = [(ref, row) for ref, row in rows if row]
    fig, axes = plt.subplots(len(rows), 3, figsize=(17, 4.5 * len(rows)), squeeze=False)
    for row_axes, (ref, row) in zip(axes, rows, strict=True):
        for i, (name, by_seed) in enumerate(row.items()):
            runs = list(by_seed.values())
            x, mean, half = fa._band(runs, "val")
            steps = [step for step, _, _ in runs[0]["val"]][:len(x)]  # every run validates at the same steps
            paired = fa.paired_val_curve(by_seed, row[ref]) if ref in row and name != ref else None
            for ax, xs, m, h in ((row_axes[0], steps, mean, half), (row_axes[1], x, mean, half),
                                 (row_axes[2], *(paired or ([], [], [])))):
                if not xs:
                    continue
                ax.plot(xs, m, marker="o", color=f"C{i % 10}", label=f"{name} (n={len(runs)})")
                ax.fill_between(xs, [a - b for a, b in zip(m, h, strict=True)],
                                [a + b for a, b in zip(m, h, strict=True)], color=f"C{i % 10}", alpha=0.15)
        row_axes[0].set_xlabel("step")
        row_axes[1].set_xlabel("generated trajectories")
        row_axes[2].set_xlabel("step")
        row_axes[2].axhline(0.0, color="black", linewidth=0.8)
        row_axes[2].set_ylabel(f"validation accuracy minus {ref} (paired by seed)")
        for ax in row_axes[:2]:
            ax.set_ylabel("validation accuracy (T=0.6)")
        for ax in row_axes:
            ax.legend(fontsize="x-small")
    fig.suptitle("Replay recipes vs on-policy GRPO: per step and per generated trajectory (mean, 95% CI over seeds; "
                 f"arms with >= {MIN_PLOT_SEEDS} seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _versus_lines(name: str, versus: dict) -> list[str]:
    lines = []
    for other, d in versus.items():
        step, traj = d["per_step"], d["per_trajectory"]
        t = traj["trajectories_to_threshold"]
        t_txt = (f"{t['mean']:+.0f}" + (f" ± {t['ci95']:.0f}" if t.get("ci95") is not None else "")
                 if t.get("mean") is not None else "n/a") + f" ({t['both_reached']})"
        lines.append(f"| {name} - {other} | {len(step['seeds'])} | " + " | ".join(
            fa._md(step[k], signed=True) for k in (*TEST_KEYS, "final_val"))
            + f" | {fa._md(traj['val_at_equal_trajectories'], signed=True)} | {t_txt} |")
    return lines


VERSUS_HEADER = ["| {} minus (paired) | seeds | per step: greedy | avg@8 T=0.6 | avg@8 T=1.0 | val (final) | "
                 "per trajectory: val at equal generation | trajectories to threshold |", "|---" * 8 + "|"]


def markdown(summary: dict) -> str:
    """Tables (points, mean ± 95% CI): per recipe its numbers and the paired differences per step and per generated
    trajectory, in the paper-ratio regime and from the weak start."""
    if not summary.get("per_recipe") and not summary.get("weak_start"):
        return "(recipes: no finished runs yet)"
    lines = ["baselines: " + "; ".join(summary.get("baseline", {}).values()), "",
             "| recipe | seeds | greedy | avg@8 T=0.6 | avg@8 T=1.0 | val (final) | generated trajectories |",
             "|---|---|---|---|---|---|---|"]
    for name, row in summary.get("per_recipe", {}).items():
        gen = row["generated_trajectories"]
        lines.append(f"| {name} | {row['greedy']['n']} | " + " | ".join(fa._md(row[k]) for k in (*TEST_KEYS,
                     "final_val")) + f" | {gen['mean']:.0f} |")
    lines += ["", VERSUS_HEADER[0].format("recipe"), VERSUS_HEADER[1]]
    for name, row in summary.get("per_recipe", {}).items():
        lines += _versus_lines(name, row["versus"])
    if any(summary.get("baseline_versus", {}).values()):
        lines += ["", VERSUS_HEADER[0].format("baseline, the paper's recipe"), VERSUS_HEADER[1]]
        for name, d in summary["baseline_versus"].items():
            lines += _versus_lines(name, d)
    if summary.get("weak_start"):
        lines += ["", "| weak start | seeds | greedy | avg@8 T=0.6 | avg@8 T=1.0 | final - start avg@8 T=0.6 "
                  "(paired) | generated trajectories | collapsed |", "|---" * 8 + "|"]
        for name, row in summary["weak_start"].items():
            lines.append(f"| {name} | {row['greedy']['n']} | " + " | ".join(fa._md(row[k]) for k in TEST_KEYS)
                         + f" | {fa._md(row['final_minus_start']['avg@8_T0.6'], signed=True)} | "
                         f"{row['generated_trajectories']['mean']:.0f} | {row['collapsed']} |")
        lines += ["", VERSUS_HEADER[0].format("weak-start recipe"), VERSUS_HEADER[1]]
        for name, row in summary["weak_start"].items():
            lines += _versus_lines(name, row["versus"])
    return "\n".join(lines)
