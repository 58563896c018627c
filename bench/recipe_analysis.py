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
* weak start: final minus start on the test split, collapsed runs, and the paired difference to weak GRPO.
Paired differences: mean and 95% CI over seeds (fidelity_analysis.ci95: t quantile, n - 1 degrees of freedom).
"""

from __future__ import annotations

import os

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


def analyse_recipes(root: str, recipes: dict, weak: dict, matched: dict, best: dict, seeds: list[int],
                    threshold: float, png: str) -> dict:
    if not best.get("exgrpo") or not best.get("grpo"):
        return {}
    lr = {"exgrpo": best["exgrpo"]["lr"], "grpo": best["grpo"]["lr"]}
    base, out = {}, {"per_recipe": {}, "weak_start": {}, "baseline": {}}
    for arm in ("exgrpo", "grpo", "weak_grpo"):
        rate = lr["grpo" if "grpo" in arm and "exgrpo" not in arm else "exgrpo"]
        same = _runs(root, f"{arm}_same_code", rate, seeds)
        base[arm] = same or _runs(root, arm, rate, seeds)
        out["baseline"][arm] = f"{arm}_same_code" if same else f"{arm} (recorded at an earlier code version)"
    curves: dict[str, list[dict]] = {arm: list(runs.values()) for arm, runs in base.items() if runs}
    for name in (n for n in recipes if not n.endswith("_same_code")):
        runs = _runs(root, name, lr["grpo" if name.startswith("grpo") else "exgrpo"], seeds)
        if not runs:
            continue
        curves[name] = list(runs.values())
        row: dict = {**fa.summarize(list(runs.values()), threshold), "versus": {}}
        others = {"grpo": base["grpo"], "exgrpo": base["exgrpo"]}
        if name in matched:
            others["matched " + matched[name]] = _runs(root, matched[name], lr["grpo"], seeds)
        for other, other_runs in others.items():
            if other_runs and name != other:
                row["versus"][other] = {"per_step": fa.paired_difference(runs, other_runs),
                                        "per_trajectory": per_trajectory(runs, other_runs, threshold)}
        out["per_recipe"][name] = row
    weak_grpo = base["weak_grpo"]
    for name in (n for n in weak if n != "weak_grpo_same_code"):
        runs = {s: r for s, r in _runs(root, name, lr["exgrpo"], seeds).items() if "start" in r}
        if runs:
            out["weak_start"][name] = {
                **fa.summarize(list(runs.values()), threshold),
                "final_minus_start": {k: fa.ci95([r["test"][k] - r["start"][k] for r in runs.values()])
                                      for k in TEST_KEYS},
                "collapsed": f"{sum(fa.collapsed(r) for r in runs.values())}/{len(runs)}",
                "minus_weak_grpo": fa.paired_difference(runs, weak_grpo) if weak_grpo else None}
    if len(curves) > 2:
        plot(curves, png)
        out["png"] = os.path.relpath(png, os.path.dirname(os.path.dirname(png)))
    return out


def plot(curves: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in curves.items():
        x, mean, half = fa._band(runs, "val")
        steps = [step for step, _, _ in runs[0]["val"]][:len(x)]  # every run validates at the same steps
        for ax, xs in ((axes[0], steps), (axes[1], x)):
            ax.plot(xs, mean, marker="o", label=f"{name} (n={len(runs)})")
            ax.fill_between(xs, [m - h for m, h in zip(mean, half, strict=True)],
                            [m + h for m, h in zip(mean, half, strict=True)], alpha=0.15)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("generated trajectories")
    for ax in axes:
        ax.set_ylabel("validation accuracy (T=0.6)")
        ax.legend(fontsize="x-small")
    fig.suptitle("Replay recipes vs on-policy GRPO: per step and per generated trajectory (mean, 95% CI over seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(summary: dict) -> str:
    """Tables (points, mean ± 95% CI): per recipe its numbers and the paired differences per step and per generated
    trajectory; the weak start."""
    if not summary.get("per_recipe") and not summary.get("weak_start"):
        return "(recipes: no finished runs yet)"
    lines = ["baselines: " + "; ".join(summary.get("baseline", {}).values()), "",
             "| recipe | seeds | greedy | avg@8 T=0.6 | avg@8 T=1.0 | val (final) | generated trajectories |",
             "|---|---|---|---|---|---|---|"]
    for name, row in summary.get("per_recipe", {}).items():
        gen = row["generated_trajectories"]
        lines.append(f"| {name} | {row['greedy']['n']} | " + " | ".join(fa._md(row[k]) for k in (*TEST_KEYS,
                     "final_val")) + f" | {gen['mean']:.0f} |")
    lines += ["", "| recipe minus (paired) | seeds | per step: greedy | avg@8 T=0.6 | avg@8 T=1.0 | val (final) | "
              "per trajectory: val at equal generation | trajectories to threshold |", "|---" * 8 + "|"]
    for name, row in summary.get("per_recipe", {}).items():
        for other, d in row["versus"].items():
            step, traj = d["per_step"], d["per_trajectory"]
            t = traj["trajectories_to_threshold"]
            t_txt = (f"{t['mean']:+.0f}" + (f" ± {t['ci95']:.0f}" if t.get("ci95") is not None else "")
                     if t.get("mean") is not None else "n/a") + f" ({t['both_reached']})"
            lines.append(f"| {name} - {other} | {len(step['seeds'])} | " + " | ".join(
                fa._md(step[k], signed=True) for k in (*TEST_KEYS, "final_val"))
                + f" | {fa._md(traj['val_at_equal_trajectories'], signed=True)} | {t_txt} |")
    if summary.get("weak_start"):
        lines += ["", "| weak start | seeds | final avg@8 T=0.6 | final - start (paired) | minus weak GRPO greedy "
                  "(paired) | collapsed |", "|---|---|---|---|---|---|"]
        for name, row in summary["weak_start"].items():
            vs = row["minus_weak_grpo"]["greedy"] if row.get("minus_weak_grpo") else None
            lines.append(f"| {name} | {row['greedy']['n']} | {fa._md(row['avg@8_T0.6'])} | "
                         f"{fa._md(row['final_minus_start']['avg@8_T0.6'], signed=True)} | {fa._md(vs, signed=True)} | "
                         f"{row['collapsed']} |")
    return "\n".join(lines)
