"""Analysis of the data-scarce comparison (bench/exgrpo_vs_grpo.py --protocol scarce) against the criteria that
docs/results.md pre-registered ("Pre-registered: replay that costs no generation, with few questions and many
epochs"), from the committed records only, on whatever seeds exist (each cell says how many seeds each arm has).

Cells: set size (256, 1,024 questions) x start (capable, weak). In each, every arm against GRPO, paired by seed (the
runs of a seed share their warm start), 95% t-intervals over the paired differences (fidelity_analysis.ci95):
* (a) greedy test accuracy at equal generated trajectories: the end-of-run test numbers when both arms generated the
  same trajectories (within 1%: arms 1-4 do); otherwise (exgrpo_append generates more) validation accuracy at the
  pair's common generation budget (recipe_analysis.per_trajectory), named as such in `a_measure`;
* (b) saving = 1 - T_arm / T_GRPO per seed, T_GRPO the generated trajectories at which GRPO first reaches its own
  peak validation accuracy, T_arm those at which the arm first reaches that value (never: saving 0); it counts when
  the mean saving is >= 0.25 and its interval excludes 0;
* (c) weak start only: the training questions at <= 1/8 correct at the warm start that reach >= 4/8 at the end
  (pass@8 probe at T = 1: start_train_probe.json, train_probe.json), arm minus GRPO.
A verdict is `pays` (the interval excludes 0 on the paying side and the threshold is met), `straddles` (the point is
on the paying side, the interval reaches 0: extend to 10 seeds, as pre-registered; at 10 seeds it does not pay),
`does not pay`, or `too few seeds` (fewer than 5 paired seeds). Each arm's verdict per criterion (`verdicts`,
`arm_verdict`): a replay arm that pays against GRPO is `replay pays` when it also pays against GRPO with one more
update pass, `more updates, not replay` when it does not (listed under `more_updates_not_replay` too), and pending
while that comparison straddles or has too few seeds; any other verdict is its verdict against GRPO. Every comparison is
also reported per step (end-of-run test and final validation), per generated trajectory (validation at equal
generation) and per training FLOP (validation at equal training tokens: `train/tokens`, prompt + response tokens of
every trained row times the update passes; a FLOP is ~6 x parameters per token for every arm of one model and these
~30-token sequences, so equal tokens = equal FLOPs).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import fidelity_analysis as fa
import recipe_analysis as rc
from experiment_arms import SCARCE_LR, SCARCE_SET_SIZES, scarce_variant

ARM_ORDER = ("grpo", "grpo_extra_pass", "ingroup_replay", "rescue_replay", "exgrpo_append")
REPLAY_ARMS = ("ingroup_replay", "rescue_replay", "exgrpo_append")
EXTRA_PASS = "grpo_extra_pass"
SAVING_AT_LEAST = 0.25
HARD_AT_MOST, CLIMBED_AT_LEAST = 1, 4  # correct of 8
PROBE_KEY = "correct_of_8_T1"  # tools/arithmetic_eval.py test --counts --temperatures 1.0
MIN_SEEDS, EXTENDED_SEEDS = 5, 10  # paired seeds for a verdict; for one whose interval straddles its threshold
EQUAL_GENERATION = 0.01  # relative difference of two runs' generated trajectories counted as equal generation
TEST_KEYS = fa.TEST_KEYS


def load(record_dir: str) -> dict | None:
    """A finished run's record (fidelity_analysis.load_run) with its cumulative training tokens per step
    (`train_tokens`), its validation points against them (`val_tokens`) and its training-question probes."""
    from exgrpo_megatron.logging.metrics import read_metrics

    run = fa.load_run(record_dir)
    if run is None or "test" not in run:
        return None
    path = os.path.join(record_dir, "metrics.jsonl")
    records = read_metrics(path + ".gz" if os.path.isfile(path + ".gz") else path)
    per_step = {r["step"]: float(r.get("train/tokens", 0.0)) for r in records if isinstance(r.get("step"), int)}
    total, tokens = 0.0, {}
    for step in run["steps"]:
        total += per_step.get(step, 0.0)
        tokens[step] = total
    run["train_tokens"] = [tokens[s] for s in run["steps"]]
    run["val_tokens"] = [(step, tokens[step], v) for step, _, v in run.get("val", [])]
    for name, key in (("start_train_probe.json", "probe_start"), ("train_probe.json", "probe_end")):
        if os.path.isfile(os.path.join(record_dir, name)):
            with open(os.path.join(record_dir, name)) as fh:
                run[key] = json.load(fh).get(PROBE_KEY)
    return run


def hard_climbed(run: dict) -> tuple[int, int] | None:
    """(questions at <= 1/8 at the warm start, those of them at >= 4/8 at the end), or None without both probes."""
    start, end = run.get("probe_start"), run.get("probe_end")
    if not start or not end or len(start) != len(end):
        return None
    hard = [i for i, c in enumerate(start) if c <= HARD_AT_MOST]
    return len(hard), sum(end[i] >= CLIMBED_AT_LEAST for i in hard)


def first_reach(points: list[tuple[int, float, float]], value: float) -> float | None:
    """The x (trajectories or tokens) of the first validation point at >= value."""
    return next((x for _, x, v in points if v >= value), None)


def saving(arm: dict, grpo: dict) -> float | None:
    """1 - T_arm / T_GRPO to GRPO's peak validation accuracy (criterion (b)); 0 when the arm never reaches it."""
    if not grpo.get("val") or not arm.get("val"):
        return None
    peak = max(v for _, _, v in grpo["val"])
    t_grpo, t_arm = first_reach(grpo["val"], peak), first_reach(arm["val"], peak)
    if not t_grpo:
        return None
    return 0.0 if t_arm is None else 1.0 - t_arm / t_grpo


def judge(ci: dict, at_least: float = 0.0) -> str:
    """The pre-registered reading of a paired mean and its 95% interval (module docstring)."""
    n = ci.get("n", 0)
    if ci.get("mean") is None or ci.get("ci95") is None or n < MIN_SEEDS:
        return f"too few seeds ({n})"
    mean, low = ci["mean"], ci["mean"] - ci["ci95"]
    if mean > 0 and mean >= at_least:
        if low > 0:
            return "pays"
        return ("does not pay (the interval still reaches 0 at 10 seeds)" if n >= EXTENDED_SEEDS
                else "straddles: extend to 10 seeds")
    return "does not pay"


def arm_verdict(versus_grpo: str, versus_extra_pass: str | None) -> str:
    """An arm's verdict on one criterion by the pre-registered rule, from its verdicts (`judge`) against GRPO and, for
    a replay arm, against GRPO with one more update pass (None for the other arms)."""
    if versus_grpo != "pays" or versus_extra_pass is None:
        return versus_grpo
    if versus_extra_pass == "pays":
        return "replay pays"
    if versus_extra_pass.startswith(("straddles", "too few")):
        return f"pays against GRPO; against one more pass: {versus_extra_pass}"
    return "more updates, not replay"


def _tokens_view(runs: dict[int, dict]) -> dict[int, dict]:
    """The runs with training tokens in place of generated trajectories (for recipe_analysis.per_trajectory)."""
    return {s: {"val": r["val_tokens"], "trajectories": r["train_tokens"]} for s, r in runs.items()}


def compare(a: dict[int, dict], b: dict[int, dict], weak: bool, threshold: float) -> dict:
    """Arm a against baseline b on the seeds both finished: criteria (a), (b), (c) with verdicts, and the paired
    differences per step, per generated trajectory and per training token."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {"seeds": []}
    a, b = {s: a[s] for s in seeds}, {s: b[s] for s in seeds}
    equal = all(abs(a[s]["trajectories"][-1] - b[s]["trajectories"][-1]) <= EQUAL_GENERATION
                * b[s]["trajectories"][-1] for s in seeds)
    per_step = fa.paired_difference(a, b)
    per_trajectory = rc.per_trajectory(a, b, threshold)["val_at_equal_trajectories"]
    per_token = rc.per_trajectory(_tokens_view(a), _tokens_view(b), threshold)["val_at_equal_trajectories"]
    crit_a = per_step["greedy"] if equal else per_trajectory
    crit_b = fa.ci95([saving(a[s], b[s]) for s in seeds])
    out: dict[str, Any] = {
        "seeds": seeds, "a_measure": "greedy test accuracy (equal generation)" if equal else
        "validation accuracy at the common generation budget (the arm generates more per step)",
        "a": crit_a, "b_saving": crit_b, "verdict": {"a": judge(crit_a), "b": judge(crit_b, SAVING_AT_LEAST)},
        "per_step": per_step, "per_trajectory_val": per_trajectory, "per_token_val": per_token}
    if weak:
        pairs = [(hard_climbed(a[s]), hard_climbed(b[s])) for s in seeds]
        crit_c = fa.ci95([x[1] - y[1] for x, y in pairs if x is not None and y is not None])
        out["c_climbed"] = crit_c
        out["verdict"]["c"] = judge(crit_c)
    return out


def _summary(runs: dict[int, dict]) -> dict:
    out: dict[str, Any] = {"seeds": sorted(runs)}
    out.update({k: fa.ci95([r["test"].get(k) for r in runs.values()]) for k in TEST_KEYS})
    out["final_val"] = fa.ci95([fa.final_val(r) for r in runs.values()])
    out["peak_val"] = fa.ci95([max((v for _, _, v in r.get("val", [])), default=None) for r in runs.values()])
    out["generated_trajectories"] = fa.ci95([r["trajectories"][-1] for r in runs.values()])
    out["train_tokens"] = fa.ci95([r["train_tokens"][-1] if r["train_tokens"] else None for r in runs.values()])
    climbs = [c for c in map(hard_climbed, runs.values()) if c is not None]
    if climbs:
        out["hard_questions"] = fa.ci95([float(h) for h, _ in climbs])
        out["hard_climbed"] = fa.ci95([float(c) for _, c in climbs])
    return out


def analyse(records: str, seeds: list[int], png: str, threshold: float = 0.5) -> dict:
    """Every cell's arms, comparisons and verdicts from the records under `records` (partial grids included)."""
    cells: dict[str, Any] = {}
    curves: dict[str, dict[str, dict[int, dict]]] = {}
    for n in SCARCE_SET_SIZES:
        for weak in (False, True):
            name = f"{'weak' if weak else 'capable'}_{n}"
            runs = {arm: {s: r for s in seeds if (r := load(fa.run_dir(records, scarce_variant(arm, n, weak),
                                                                         SCARCE_LR, s)))} for arm in ARM_ORDER}
            if not any(runs.values()):
                continue
            curves[name] = runs
            versus: dict[str, dict] = {}
            for arm in ARM_ORDER[1:]:
                if runs[arm]:
                    baselines = ("grpo", EXTRA_PASS) if arm in REPLAY_ARMS else ("grpo",)
                    versus[arm] = {base: compare(runs[arm], runs[base], weak, threshold) for base in baselines}
            verdicts = {arm: {c: arm_verdict(v, d.get(EXTRA_PASS, {}).get("verdict", {}).get(c) if arm in REPLAY_ARMS
                                             else None) for c, v in d["grpo"].get("verdict", {}).items()}
                        for arm, d in versus.items()}
            not_replay = {arm: [c for c, v in by_c.items() if v == "more updates, not replay"]
                          for arm, by_c in verdicts.items()}
            cells[name] = {"seeds_per_arm": {arm: len(r) for arm, r in runs.items()},
                           "arms": {arm: _summary(r) for arm, r in runs.items() if r}, "versus": versus,
                           "verdicts": verdicts, "more_updates_not_replay": {a: c for a, c in not_replay.items() if c}}
    out: dict[str, Any] = {"cells": cells, "lr": SCARCE_LR}
    if curves:
        plot(curves, png)
        out["png"] = os.path.relpath(png, os.path.dirname(os.path.dirname(png)))
    return out


def write_summary(records: str, seeds: list[int], out_json: str, out_png: str, failed: list[str],
                  provenance: dict) -> int:
    """`analyse` as JSON (with `provenance`: the command, the variants' overrides, the machine), Markdown beside it
    and the curves PNG; prints the tables. Returns 1 if a run failed."""
    summary = {**analyse(records, seeds, out_png), **provenance, "seeds": seeds, "failed_runs": failed}
    summary["markdown"] = markdown(summary)
    os.makedirs(os.path.dirname(out_json) or ".", exist_ok=True)
    with open(out_json, "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.splitext(out_json)[0] + ".md", "w") as fh:
        fh.write(summary["markdown"] + "\n")
    print(summary["markdown"])
    print(f"wrote {out_json}" + (f" and {out_png}" if "png" in summary else "") + (f"; FAILED: {failed}" if failed
                                                                                      else ""))
    return 1 if failed else 0


def _mean_curve(runs: list[dict], x_key: str) -> tuple[list[float], list[float], list[float]]:
    """Validation points averaged over runs (every run validates at the same steps): x, mean, 95% half-width."""
    series = [r["val_tokens"] if x_key == "tokens" else r.get("val", []) for r in runs]
    n = min(len(s) for s in series)
    xs = [statistics.fmean((p[i][0] if x_key == "step" else p[i][1]) for p in series) for i in range(n)]
    cis = [fa.ci95([p[i][2] for p in series]) for i in range(n)]
    return xs, [c["mean"] for c in cis], [c["ci95"] or 0.0 for c in cis]


def plot(curves: dict[str, dict[str, dict[int, dict]]], path: str) -> None:
    """One row per cell: validation accuracy against steps, generated trajectories and training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(curves), 3, figsize=(17, 4.2 * len(curves)), squeeze=False)
    for row, (cell, runs) in zip(axes, curves.items(), strict=True):
        for i, arm in enumerate(ARM_ORDER):
            if not runs[arm]:
                continue
            for ax, x_key in zip(row, ("step", "trajectories", "tokens"), strict=True):
                xs, mean, half = _mean_curve(list(runs[arm].values()), x_key)
                ax.plot(xs, mean, marker="o", markersize=3, color=f"C{i}", label=f"{arm} (n={len(runs[arm])})")
                ax.fill_between(xs, [m - h for m, h in zip(mean, half, strict=True)],
                                [m + h for m, h in zip(mean, half, strict=True)], color=f"C{i}", alpha=0.12)
        for ax, label in zip(row, ("step", "generated trajectories", "training tokens (~ training FLOPs)"),
                             strict=True):
            ax.set_xlabel(label)
            ax.set_ylabel(f"{cell}: validation accuracy (T=0.6)")
            ax.legend(fontsize="x-small")
    fig.suptitle("Data-scarce regime: validation accuracy per step, per generated trajectory and per training token "
                 "(mean, 95% CI over seeds)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(summary: dict) -> str:
    """Per cell: the arms' numbers (with their seed counts), each comparison's criteria, verdicts and paired
    differences per step / generated trajectory / training token (points, mean ± 95% CI), and each arm's verdict."""
    if not summary.get("cells"):
        return "(scarce: no finished runs yet)"
    lines = []
    for cell, d in summary["cells"].items():
        lines += [f"### {cell.replace('_', ' start, ')} questions", "",
                  "| arm | seeds | greedy | avg@8 T=1.0 | val (final) | val (peak) | generated trajectories | "
                  "training tokens | hard at start / climbed to >= 4/8 |", "|---" * 9 + "|"]
        for arm, row in d["arms"].items():
            hard = (f"{fa._md(row['hard_questions'], scale=1)} / {fa._md(row['hard_climbed'], scale=1)}"
                    if "hard_climbed" in row else "n/a")
            lines.append(f"| {arm} | {len(row['seeds'])} | {fa._md(row['greedy'])} | {fa._md(row['avg@8_T1'])} | "
                         f"{fa._md(row['final_val'])} | {fa._md(row['peak_val'])} | "
                         f"{row['generated_trajectories']['mean']:.0f} | {row['train_tokens']['mean'] or 0:.0f} | "
                         f"{hard} |")
        lines += ["", "| arm minus (paired) | seeds | (a) | verdict | (b) saving | verdict | (c) climbed | verdict | "
                  "per step: greedy | val (final) | per trajectory: val | per token: val |", "|---" * 12 + "|"]
        for arm, by_base in d["versus"].items():
            for base, c in by_base.items():
                if not c["seeds"]:
                    continue
                v, step = c["verdict"], c["per_step"]
                cells_ = [fa._md(c["a"], signed=True), v["a"], fa._md(c["b_saving"], signed=True), v["b"],
                          fa._md(c.get("c_climbed"), signed=True, scale=1), v.get("c", "n/a"),
                          fa._md(step["greedy"], signed=True), fa._md(step["final_val"], signed=True),
                          fa._md(c["per_trajectory_val"], signed=True), fa._md(c["per_token_val"], signed=True)]
                lines.append(f"| {arm} - {base} | {len(c['seeds'])} | " + " | ".join(cells_) + " |")
        measures = {c["a_measure"] for by_base in d["versus"].values() for c in by_base.values() if c["seeds"]}
        lines += ["", "(a) measured as: " + ("; ".join(sorted(measures)) or "n/a (no arm paired with a baseline yet)"),
                  "", "| verdict by the pre-registered rule | (a) | (b) | (c) |", "|---" * 4 + "|"]
        lines += [f"| {arm} | " + " | ".join(by_c.get(c, "n/a") for c in "abc") + " |"
                  for arm, by_c in d["verdicts"].items() if by_c]
        lines.append("")
    return "\n".join(lines)
