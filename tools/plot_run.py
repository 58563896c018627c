"""Plot a run's metrics.jsonl: reward, entropy, response length and the experience pool's bucket histogram.

    python tools/plot_run.py RUN_DIR [--out PNG]      # default output: RUN_DIR/metrics.png

The panels plot the keys the trainer logs (see exgrpo_megatron/trainer.py); a panel whose keys are
absent says "no data". Bucket k of the pool histogram counts questions with k of K rollouts correct.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any

from exgrpo_megatron.logging.metrics import read_metrics

PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean", "reward/fresh_mean", "reward/replay_mean"),
    "entropy": ("entropy/mean",),
    "response length": ("response_length/mean",),
}
BUCKET_PATTERN = re.compile(r"^experience/bucket_(\d+)$")


def series(records: list[dict[str, Any]], key: str) -> list[float]:
    """``key`` per record; NaN where it is missing or not a number (e.g. no replay before mixed mode)."""
    out = []
    for record in records:
        value = record.get(key)
        out.append(float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan)
    return out


def panel_keys(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The keys each panel plots: the trainer's keys present in the file, and every pool bucket in k order."""
    present = {key for record in records for key in record}
    chosen = {title: [k for k in keys if k in present] for title, keys in PANELS.items()}
    buckets = [k for k in present if BUCKET_PATTERN.match(k)]
    chosen["pool buckets"] = sorted(buckets, key=lambda k: int(BUCKET_PATTERN.match(k).group(1)))  # type: ignore
    return chosen


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write the figure for ``run_dir`` and return its path; FileNotFoundError if there is no metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir!r} (expected {path})")
    records = sorted((r for r in read_metrics(path) if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for ax, (title, keys) in zip(axes.flat, panel_keys(records).items(), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        if not keys:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        if title == "pool buckets":
            values = [[0.0 if math.isnan(v) else v for v in series(records, k)] for k in keys]
            labels = [f"k={BUCKET_PATTERN.match(k).group(1)}" for k in keys]  # type: ignore[union-attr]
            ax.stackplot(steps, values, labels=labels)
            ax.set_ylabel("questions")
        else:
            for key in keys:
                ax.plot(steps, series(records, key), label=key)
        ax.legend(fontsize="small", loc="best")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


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
