"""Plot a run's metrics.jsonl: reward and validation accuracy, how much of each batch is replayed, the
experience pool's bucket histogram, entropy, response length and the time per step.

    python tools/plot_run.py RUN_DIR [--out PNG]      # default output: RUN_DIR/metrics.png

The panels plot the keys the trainer logs (exgrpo_megatron/training/trainer.py, step_metrics.py); a panel whose keys
are absent says "no data". The reward panel shows the mean reward of the step's generated (fresh) rollouts,
not of replayed trajectories: those were stored because they were correct, so their reward is 1 by
construction. The replay panel shows the share of the batch's questions drawn from the pool
(experience/n_replayed / trainer.train_batch_size of RUN_DIR/config.yaml) and the share of trained tokens
that are replayed trajectories. Bucket k of the pool histogram counts questions with k of K rollouts correct.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any

from exgrpo_megatron.logging.metrics import read_metrics

# title -> (key, legend label) for the line panels; "pool buckets" is added from the bucket keys present
PANELS: dict[str, tuple[tuple[str, str], ...]] = {
    "reward": (("reward/fresh_mean", "train: generated rollouts"),),
    "replayed share of the batch": (("replay/question_share", "questions from the pool"),
                                    ("replay/token_fraction", "trained tokens from replay")),
    "entropy": (("entropy/mean", "policy entropy (nats/token)"),),
    "response length": (("response_length/mean", "tokens"),),
    "time per step": (("time/step", "step"), ("time/generate", "generate"), ("time/train", "train")),
}
VAL_PATTERN = re.compile(r"^val/avg@\d+$")
BUCKET_PATTERN = re.compile(r"^experience/bucket_(\d+)$")


def series(records: list[dict[str, Any]], key: str) -> list[float]:
    """``key`` per record; NaN where it is missing or not a number (e.g. no replay before mixed mode)."""
    out = []
    for record in records:
        value = record.get(key)
        out.append(float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan)
    return out


def add_question_share(records: list[dict[str, Any]], batch_size: int | None, appended: bool = False) -> None:
    """``replay/question_share``: the share of the step's questions drawn from the pool, into each record that has
    experience/n_replayed: n / B where replays displace fresh questions, n / (B + n) where they are appended
    (experience.placement=append)."""
    if not batch_size:
        return
    for record in records:
        n = record.get("experience/n_replayed")
        if isinstance(n, (int, float)):
            record["replay/question_share"] = float(n) / (batch_size + (float(n) if appended else 0.0))


def panel_keys(records: list[dict[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """(key, label) of each panel: the trainer's keys present in the file (validation at whatever avg@k it ran),
    and every pool bucket in k order."""
    present = {key for record in records for key in record}
    chosen = {title: [(k, label) for k, label in keys if k in present] for title, keys in PANELS.items()}
    for key in sorted(k for k in present if VAL_PATTERN.match(k)):
        chosen["reward"].append((key, f"validation accuracy ({key.split('/')[1]})"))
    buckets = sorted((k for k in present if BUCKET_PATTERN.match(k)), key=lambda k: int(_bucket(k)))
    chosen["pool buckets"] = [(k, f"k={_bucket(k)}") for k in buckets]
    return chosen


def _bucket(key: str) -> str:
    match = BUCKET_PATTERN.match(key)
    assert match is not None
    return match.group(1)


def _run_config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def run_batch_size(run_dir: str) -> int | None:
    """trainer.train_batch_size from RUN_DIR/config.yaml (None without one)."""
    value = (_run_config(run_dir).get("trainer") or {}).get("train_batch_size")
    return int(value) if isinstance(value, int) else None


def run_appends_replays(run_dir: str) -> bool:
    """Does the run append its replayed questions to the fresh ones (experience.placement=append)?"""
    return (_run_config(run_dir).get("experience") or {}).get("placement") == "append"


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write the figure for ``run_dir`` and return its path; FileNotFoundError if there is no metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir!r} (expected {path})")
    records = sorted((r for r in read_metrics(path) if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    add_question_share(records, run_batch_size(run_dir), run_appends_replays(run_dir))
    fig = figure(records, os.path.basename(os.path.abspath(run_dir)))
    out = out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def figure(records: list[dict[str, Any]], title: str) -> Any:
    """The 2 x 3 panels of ``records`` (sorted by step) as a matplotlib figure."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharex=True)
    for ax, (name, keys) in zip(axes.flat, panel_keys(records).items(), strict=True):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)  # sharex hides the top row's step labels otherwise
        if not keys:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        if name == "pool buckets":
            values = [[0.0 if math.isnan(v) else v for v in series(records, k)] for k, _ in keys]
            ax.stackplot(steps, values, labels=[label for _, label in keys])
            ax.set_ylabel("questions")
        else:
            for key, label in keys:
                xy = [(x, y) for x, y in zip(steps, series(records, key), strict=True) if not math.isnan(y)]
                sparse = len(xy) < len(steps) / 2  # logged every few steps (validation): markers
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o" if sparse else None, label=label)
            if name in ("reward", "replayed share of the batch"):
                ax.set_ylim(-0.02, 1.02)
            ax.set_ylabel({"reward": "mean reward / accuracy", "replayed share of the batch": "share",
                           "time per step": "seconds"}.get(name, keys[0][1] if len(keys) == 1 else ""))
        ax.legend(fontsize="small", loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.out)
    except FileNotFoundError as exc:
        print(f"plot_run: {exc}", file=sys.stderr)
        return 1
    print(f"plot_run: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
