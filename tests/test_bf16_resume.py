"""The CPU bf16 path through the real training loop: a bf16 run (bf16 model; fp32 main params and Adam state in
megatron's mixed-precision optimizer) stopped after step 2 and resumed with checkpoint.resume=auto reproduces
the uninterrupted 4-step bf16 run bitwise (per-step metrics, weights, fp32 main params and Adam moments), and
its last checkpoint exports to a HuggingFace directory that transformers loads and that holds the run's bf16
weights exactly (tools/convert_megatron_to_hf.py --dtype bf16)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from exgrpo_megatron.checkpoint import find_latest
from exgrpo_megatron.logging import read_metrics
from tests.test_trainer_resume import (
    _assert_same_metrics,
    _assert_same_tensors,
    _ckpt,
    _model_tensors,
    _overrides,
    _train,
    _write_dataset,
)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
BF16 = ("model.params_dtype=bf16",)


def test_bf16_run_stopped_and_resumed_reproduces_the_uninterrupted_run_bitwise(tmp_path):
    data = _write_dataset(tmp_path / "train.jsonl")
    ref, run = tmp_path / "reference", tmp_path / "resumed"
    log = _train(ref, _overrides(data, STEPS, extra=BF16), worker_args=("--make-init", str(tmp_path / "init")))
    assert "CPU precision: bf16 (fp32 main params and Adam state)" in log
    reference = read_metrics(str(ref / "metrics.jsonl"))
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    _train(run, _overrides(data, 2, extra=BF16), worker_args=("--make-init", str(tmp_path / "init2")), tag="a")
    log = _train(run, _overrides(data, STEPS, extra=BF16), tag="b")
    assert f"resumed from {_ckpt(run, 2)} at step 2" in log
    _assert_same_metrics(run, reference)
    want = _model_tensors(_ckpt(ref, STEPS), tmp_path)
    weights = {k: v for k, v in want.items() if k.startswith("decoder.") or k.startswith("embedding.")}
    assert weights and all(v.dtype == torch.bfloat16 for v in weights.values())  # the model itself is bf16
    fp32_state = [k for k, v in want.items() if k.startswith("optimizer.") and v.dtype == torch.float32]
    assert fp32_state  # Adam moments (and main params) in fp32
    _assert_same_tensors(_model_tensors(_ckpt(run, STEPS), tmp_path), want)


def test_a_bf16_run_exports_to_hf_with_its_weights(tmp_path):
    data = _write_dataset(tmp_path / "train.jsonl")
    run, export = tmp_path / "run", tmp_path / "hf"
    _train(run, _overrides(data, 2, extra=BF16), worker_args=("--make-init", str(tmp_path / "init")))
    subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", str(run), str(export), "--dtype", "bf16"],
                   check=True, capture_output=True, cwd=ROOT)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    trained = _model_tensors(find_latest(run), tmp_path)
    embedding = trained["embedding.word_embeddings.weight"]
    assert embedding.dtype == torch.bfloat16
    hf_embedding = hf.get_input_embeddings().weight
    assert torch.equal(hf_embedding, embedding[: hf_embedding.shape[0]])
