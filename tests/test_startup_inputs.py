"""Inputs that must stop `exgrpo-train` at start-up with exit 2 and a message naming what to fix, not a traceback:

* a .parquet data file that is empty (0 bytes), garbage, or lacks the prompt / answer column: the file (and key);
* an exported MASTER_PORT another process listens on: the port, and how to find the process or change the port;
* ground-truth answers Math-Verify cannot parse: counted and shown at load; above data.max_unparsable_answers the
  run is refused.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_startup_inputs.py -x
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from exgrpo_megatron.data.datasets import DataFileError, load_prompt_dataset
from exgrpo_megatron.data.tokenizer import CharTokenizer
from tests.test_trainer_resume import _overrides, _write_dataset

REPO = Path(__file__).resolve().parents[1]
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


def _parquet(path: Path, columns: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _train(run_dir: Path, data: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS} | {"PYTHONPATH": str(REPO)}
    overrides = [*_overrides(data, 2), f"logging.run_dir={run_dir}"]
    return subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", *overrides], capture_output=True, text=True,
                          timeout=300, env=base | (env or {}), cwd=REPO)


@pytest.mark.parametrize("damage", ["empty", "garbage", "no_prompt_column", "no_answer_column"])
def test_an_unreadable_parquet_file_is_named(tmp_path, damage):
    path = tmp_path / f"{damage}.parquet"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(os.urandom(3000))
    elif damage == "no_prompt_column":
        _parquet(path, {"question": ["What is 1+1?"], "reward_model": [{"ground_truth": "2"}]})
    else:
        _parquet(path, {"prompt": ["What is 1+1?"], "solution": ["2"]})
    match = {"no_prompt_column": "no column 'prompt' \\(data.prompt_key\\)",
             "no_answer_column": "no column 'reward_model.ground_truth' \\(data.answer_key\\)"}.get(
        damage, "not a readable parquet file")
    with pytest.raises(DataFileError, match=f"{path}: {match}"):  # old code: ArrowInvalid / ValueError, exit 1
        load_prompt_dataset(str(path), tokenizer=CharTokenizer(), template="plain", max_prompt_length=40)


def test_exgrpo_train_exits_2_naming_an_empty_parquet_file(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"")
    done = _train(tmp_path / "run", str(path))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{path}: not a readable parquet file (0 bytes)" in done.stderr and "Traceback" not in done.stderr


def test_a_busy_exported_master_port_exits_2_naming_it(tmp_path):
    data = _write_dataset(tmp_path / "train.jsonl")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _train(tmp_path / "run", data, env={"MASTER_PORT": str(port)})
    assert done.returncode == 2, done.stderr[-3000:]  # old code: DistNetworkError EADDRINUSE, exit 1
    assert f"MASTER_PORT: {port} on 127.0.0.1 is in use" in done.stderr, done.stderr[-3000:]
    assert "unset MASTER_PORT" in done.stderr and "Traceback" not in done.stderr


def _dataset_with_answers(tmp_path: Path, answers: list[str]):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}?", "reward_model": {"ground_truth": a}}) + "\n"
                            for i, a in enumerate(answers)))
    return load_prompt_dataset(str(path), tokenizer=CharTokenizer(), template="plain", max_prompt_length=40)


def test_gold_answers_that_do_not_parse_are_counted_then_refused_above_the_threshold(tmp_path, caplog):
    from exgrpo_megatron.data.answer_check import UnparsableAnswersError, require_parsable_answers

    answers = ["7", "\\frac{1}{2}", "[[[", "x^2+1", "$$", "42", "0.5", "\\sqrt{2}", "3", "[[["]
    dataset = _dataset_with_answers(tmp_path, answers)
    check = require_parsable_answers(dataset, ["rows.jsonl"], 0.5, timeout_seconds=5)  # 3 of 10: a warning
    assert check.unparsable == [(2, "[[["), (4, "$$"), (9, "[[[")]
    assert "3 of 10 rows" in caplog.text and "qid 2: '[[['" in caplog.text  # old code: no check, no word
    with pytest.raises(UnparsableAnswersError, match=r"data.max_unparsable_answers: 3 of 10 rows .* \(30.0%\)"):
        require_parsable_answers(dataset, ["rows.jsonl"], 0.05, timeout_seconds=5)
    assert issubclass(UnparsableAnswersError, DataFileError)  # exgrpo-train exits 2 on it, as on a bad data file
