"""MetricsLogger (JSONL + TensorBoard, resume truncation), config saving, progress bar, timers, tools/plot_run.py."""

from __future__ import annotations

import glob
import gzip
import importlib.util
import io
import json
import math
import os
import time

import numpy as np
import pytest
import torch

from exgrpo_megatron.logging import MetricsLogger, ProgressBar, StepTimer, read_metrics, save_resolved_config
from exgrpo_megatron.logging.metrics import PREVIOUS_METRICS_FILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]  # strict: every line must be valid JSON


def test_metrics_jsonl_and_tensorboard(tmp_path):
    run_dir = str(tmp_path / "run")
    with MetricsLogger(run_dir, tensorboard=True, wandb_project=None, enabled=True) as mlog:
        for step in (1, 2, 3):
            mlog.log(step, {"reward/mean": 0.25 * step, "experience/questions": np.int64(10 * step),
                            "actor/entropy_mean": torch.tensor(1.5), "phase": "warmup", "bad": float("nan")})
    records = _lines(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1] == {"step": 2, "reward/mean": 0.5, "experience/questions": 20, "actor/entropy_mean": 1.5,
                          "phase": "warmup", "bad": None}
    events = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "phase" not in acc.Tags()["scalars"] and "bad" not in acc.Tags()["scalars"]
    with pytest.raises(ValueError, match="reserved"):
        MetricsLogger(str(tmp_path / "r2"), tensorboard=False).log(1, {"step": 3})


def test_resume_truncates_later_steps_and_torn_line(tmp_path):
    run_dir = str(tmp_path / "run")
    with MetricsLogger(run_dir, tensorboard=False) as mlog:
        for step in range(1, 6):
            mlog.log(step, {"reward/mean": float(step)})
    with open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8") as fh:
        fh.write('{"step": 6, "reward/me')  # a crash mid-line
    with MetricsLogger(run_dir, tensorboard=False, resume_step=3) as mlog:
        assert [r["step"] for r in _lines(run_dir)] == [1, 2, 3]
        for step in (4, 5):
            mlog.log(step, {"reward/mean": 100.0 + step})
    records = _lines(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in records] == [1.0, 2.0, 3.0, 104.0, 105.0]
    assert read_metrics(os.path.join(run_dir, "metrics.jsonl")) == records


def test_read_metrics_reads_a_compressed_record_and_ignores_its_torn_line(tmp_path):
    """Committed benchmark records keep metrics.jsonl gzip-compressed; the reader is the same."""
    lines = '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.75}\n{"step": 3, "rew'
    path = tmp_path / "metrics.jsonl.gz"
    path.write_bytes(gzip.compress(lines.encode()))
    assert read_metrics(str(path)) == [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]


def test_fresh_run_moves_old_metrics_and_disabled_writes_nothing(tmp_path):
    run_dir = str(tmp_path / "run")
    with MetricsLogger(run_dir, tensorboard=False) as mlog:
        mlog.log(1, {"a": 1})
    with MetricsLogger(run_dir, tensorboard=False) as mlog:
        mlog.log(1, {"a": 2})
    assert _lines(run_dir) == [{"step": 1, "a": 2}]
    with open(os.path.join(run_dir, PREVIOUS_METRICS_FILE), encoding="utf-8") as fh:
        assert json.loads(fh.readline()) == {"step": 1, "a": 1}
    other = str(tmp_path / "rank1")
    mlog = MetricsLogger(other, tensorboard=True, enabled=False)
    assert mlog.log(1, {"a": 1}) == {}
    mlog.close()
    assert not os.path.exists(other)


def test_wandb_missing_gives_clear_error(tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    with pytest.raises(RuntimeError, match="wandb is not installed"):
        MetricsLogger(str(tmp_path / "run"), tensorboard=False, wandb_project="exgrpo")


def test_save_resolved_config(tmp_path):
    path = save_resolved_config(str(tmp_path / "run"), "seed: 1\nmodel:\n  name: tiny")
    assert path == str(tmp_path / "run" / "config.yaml")
    with open(path, encoding="utf-8") as fh:
        assert fh.read() == "seed: 1\nmodel:\n  name: tiny\n"


def test_progress_bar_shows_metrics_and_step():
    out = io.StringIO()
    bar = ProgressBar(total_steps=10, start_step=4, enabled=True, file=out, mininterval=0.0)
    bar.update(5, {"reward/mean": 0.5, "batch/solved": 0.375, "experience/questions": 12.0})
    bar.update(6, {"reward/mean": 0.625})
    bar.close()
    text = out.getvalue()
    assert "5/10" in text and "6/10" in text
    assert "reward=0.500" in text and "pass=0.375" in text and "pool=12" in text
    assert "reward=0.625, pass=0.375, pool=12" in text  # fields absent from a step keep their last value
    silent = io.StringIO()
    off = ProgressBar(total_steps=10, enabled=False, file=silent)
    off.update(3, {"reward/mean": 1.0})
    off.close()
    assert silent.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_file_is_whole_lines_with_messages_between_and_the_last_step_once():
    log = io.StringIO()  # not a terminal: a log file or a pipe
    bar = ProgressBar(total_steps=3, enabled=True, file=log, mininterval=0.0)
    for step in (1, 2, 3):
        bar.update(step, {"reward/mean": step / 4})
        if step == 2:
            bar.write("exgrpo-train: saved checkpoint runs/x/checkpoints/step_00000002")
    bar.write("exgrpo-train: saved checkpoint runs/x/checkpoints/step_00000003")
    bar.close()
    lines = log.getvalue().split("\n")
    assert "\r" not in log.getvalue() and lines[-1] == ""
    assert lines[0].startswith("train: step 1/3 (33%)") and lines[0].endswith("; reward=0.250")
    assert lines[2] == "exgrpo-train: saved checkpoint runs/x/checkpoints/step_00000002"
    assert lines[3].startswith("train: step 3/3 (100%)") and " s/step, remaining 00:00" in lines[3]
    assert lines[4] == "exgrpo-train: saved checkpoint runs/x/checkpoints/step_00000003" and len(lines) == 6
    assert sum("100%" in line for line in lines) == 1


def test_progress_in_a_log_file_is_throttled_and_a_stop_early_prints_the_last_step():
    log = io.StringIO()
    bar = ProgressBar(total_steps=100, start_step=10, enabled=True, file=log, mininterval=3600.0)
    for step in range(11, 41):
        bar.update(step, {"batch/solved": 0.5})
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["train: step 11/100", "train: step 40/100"]


def test_progress_on_a_terminal_writes_messages_above_the_bar():
    term = _Terminal()
    bar = ProgressBar(total_steps=4, enabled=True, file=term, mininterval=0.0)
    bar.update(1, {"reward/mean": 0.5})
    bar.write("exgrpo-train: saved checkpoint X")
    bar.close()
    text = term.getvalue()
    assert "\nexgrpo-train: saved checkpoint X\n" in text.replace("\r", "\n")
    assert "1/4" in text and "reward=0.500" in text


def test_step_timer_accumulates_and_resets():
    calls = []
    timer = StepTimer(synchronize=lambda: calls.append(1))
    with timer("generate"):
        time.sleep(0.03)
    with timer("generate"):
        time.sleep(0.03)
    with timer("train"):
        pass
    metrics = timer.pop_metrics()
    assert set(metrics) == {"time/generate", "time/train"}
    assert metrics["time/generate"] >= 0.06 and metrics["time/train"] < 0.03
    assert len(calls) == 6 and timer.pop_metrics() == {}


def _load_plot_run():
    spec = importlib.util.spec_from_file_location("plot_run", os.path.join(REPO, "tools", "plot_run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_run_writes_png(tmp_path, capsys):
    plot_run = _load_plot_run()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer:\n  train_batch_size: 8\n")
    with open(run_dir / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for step in range(1, 21):
            record = {"step": step, "reward/mean": step / 20, "reward/fresh_mean": step / 25,
                      "reward/replay_mean": None if step < 5 else 1.0, "entropy/mean": 2 - step / 20,
                      "response_length/mean": 30 + step, "phase": "mixed", "time/step": 1.5,
                      "experience/n_replayed": 0.0 if step < 5 else 4.0, "replay/token_fraction": step / 100}
            record.update({f"experience/bucket_{k}": float((k + step) % 5) for k in range(9)})
            if step % 5 == 0:
                record["val/avg@4"] = step / 30
            fh.write(json.dumps(record) + "\n")
    assert plot_run.main([str(run_dir)]) == 0
    png = run_dir / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    plot_run.add_question_share(records, plot_run.run_batch_size(str(run_dir)))
    assert [r["replay/question_share"] for r in records][3:5] == [0.0, 0.5]  # 4 of 8 questions from the pool
    plot_run.add_question_share(records, 8, appended=True)  # 4 replayed on top of 8 fresh: 4 of 12
    assert [r["replay/question_share"] for r in records][3:5] == [0.0, 4 / 12]
    chosen = {title: [key for key, _ in keys] for title, keys in plot_run.panel_keys(records).items()}
    assert chosen["reward"] == ["reward/fresh_mean", "val/avg@4"]  # not the replayed trajectories' reward (1)
    assert chosen["replayed share of the batch"] == ["replay/question_share", "replay/token_fraction"]
    assert chosen["pool buckets"] == [f"experience/bucket_{k}" for k in range(9)]
    assert chosen["entropy"] == ["entropy/mean"] and chosen["response length"] == ["response_length/mean"]
    assert chosen["time per step"] == ["time/step"]
    assert math.isnan(plot_run.series(records, "val/avg@4")[0])
    fig = plot_run.figure(records, "run")
    fig.canvas.draw()
    for ax in fig.axes:  # every panel labels its steps, the top row too
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_visible()]
        assert any(label.strip() for label in labels), ax.get_title()
        assert ax.get_legend() is not None and ax.get_ylabel(), ax.get_title()
    custom = tmp_path / "custom.png"
    assert plot_run.main([str(run_dir), "--out", str(custom)]) == 0
    assert custom.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert plot_run.main([str(tmp_path / "missing")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
