"""Per-step metrics: ``<run_dir>/metrics.jsonl`` (the record of truth), TensorBoard and optionally wandb.

One JSON object per line, ``{"step": s, "<group>/<name>": value, ...}``, flushed and fsynced as it is written,
so a crash loses at most the line being written. Non-finite floats are written as ``null`` (strict JSON).

Failure it survives: a crash after step T with the last checkpoint at step C < T. The resumed run creates the
logger with ``resume_step=C``; lines with ``step > C`` (and a torn last line) are dropped before appending, so
metrics.jsonl never holds two records of one step; TensorBoard hides the same steps through its
``purge_step`` mechanism. A fresh run (``resume_step=None``) in a directory that already has a metrics.jsonl
moves it to ``metrics.prev.jsonl`` instead of mixing two runs.

Only rank 0 logs: other ranks pass ``enabled=False`` and every method is a no-op.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import uuid
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PREVIOUS_METRICS_FILE = "metrics.prev.jsonl"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id.txt"

Scalar = float | int | str | None


def to_json_value(value: Any) -> Scalar:
    """A JSON-safe scalar: python/numpy/torch numbers become int/float (non-finite -> None), str stays."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if hasattr(value, "item"):  # numpy scalar / 0-d array / one-element torch tensor
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric value of type {type(value).__name__} is not a number or string")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def truncate_metrics_file(path: str, resume_step: int) -> tuple[int, int]:
    """Keep only records with ``step <= resume_step`` (dropping unparsable lines); returns (kept, dropped)."""
    if not os.path.exists(path):
        return 0, 0
    kept: list[str] = []
    dropped = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                dropped += 1
                continue
            if isinstance(step, int) and step <= resume_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    _atomic_write(path, "".join(kept))
    return len(kept), dropped


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl, or of a gzip-compressed one (`.gz`, as the committed benchmark
    records are kept); a torn last line is ignored."""
    records = []
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as fh:
        for line in fh:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return records


def save_resolved_config(run_dir: str, yaml_text: str) -> str:
    """Write the resolved config to ``<run_dir>/config.yaml`` atomically (rank 0 only); returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    _atomic_write(path, yaml_text if yaml_text.endswith("\n") else yaml_text + "\n")
    return path


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl, TensorBoard (optional) and wandb (optional)."""

    def __init__(self, run_dir: str, *, tensorboard: bool = True, wandb_project: str | None = None,
                 enabled: bool = True, resume_step: int | None = None, wandb_run_name: str | None = None,
                 wandb_config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._tb: Any = None
        self._wandb_run: Any = None
        self._file: Any = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if resume_step is not None:
            kept, dropped = truncate_metrics_file(self.path, resume_step)
            if dropped:
                logger.info("metrics.jsonl: resumed at step %d, kept %d records, dropped %d", resume_step, kept,
                            dropped)
        elif os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            previous = os.path.join(run_dir, PREVIOUS_METRICS_FILE)
            os.replace(self.path, previous)
            logger.warning("fresh run in %s: the existing metrics.jsonl was moved to %s", run_dir, previous)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events at steps >= it that earlier writers left in the directory.
            purge_step = resume_step + 1 if resume_step is not None else 0
            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, TENSORBOARD_DIR), purge_step=purge_step)
        if wandb_project:
            self._wandb_run = self._init_wandb(wandb_project, wandb_run_name, wandb_config, resume_step)

    def _init_wandb(self, project: str, name: str | None, config: Mapping[str, Any] | None,
                    resume_step: int | None) -> Any:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(f"logging.wandb_project={project!r} is set but wandb is not installed; "
                               "`pip install wandb` or set logging.wandb_project=null") from exc
        id_path = os.path.join(self.run_dir, WANDB_ID_FILE)
        if resume_step is not None and os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as fh:
                run_id = fh.read().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            _atomic_write(id_path, run_id + "\n")
        return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=self.run_dir,
                          config=dict(config) if config is not None else None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Scalar]:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl and send the numbers to TB / wandb."""
        if not self.enabled:
            return {}
        record: dict[str, Scalar] = {"step": int(step)}
        for key, value in metrics.items():
            if key == "step":
                raise ValueError("'step' is reserved in metrics")
            record[key] = to_json_value(value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, global_step=int(step))
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=int(step))
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
