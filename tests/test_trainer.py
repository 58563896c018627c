"""The training loop end to end on tiny models: layout invariance of the per-step metrics, the
metrics file contract, and data rows that are reported and skipped. DP=2 with a sharded pool, replay and
TensorBoard: tests/test_trainer_replay.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks

REQUIRED_KEYS = [
    "step", "phase", "reward/mean", "reward/fresh_mean", "reward/replay_mean", "experience/questions",
    "experience/trajectories", "experience/retired", "experience/n_replayed", "loss/policy", "entropy/mean",
    "response_length/mean", "replay/is_weight_mean", "grad_norm", "lr", "mismatch/token_mult_prob_error",
    "time/generate", "time/reward", "time/train", "time/step", "throughput/tokens_per_s",
]
COMPARED = ["response_length/mean", "reward/mean", "entropy/mean", "loss/entropy_bonus", "loss/policy", "grad_norm",
            "mismatch/token_mult_prob_error"]


def _overrides(run_dir: str, tp: int = 1, pp: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "model=tiny_qwen2", "model.vocab_size=103", f"logging.run_dir={run_dir}", "logging.tensorboard=false",
        "logging.progress_bar=false",
        "trainer.total_steps=3", "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=4",
        "experience.admit_correct_at_most=3", "experience.delayed_start_pass_rate=0", "trainer.sft_warm_start_steps=0",
        "trainer.val_every=0", "data.max_response_length=12", "data.num_train_examples=64",
        "trainer.micro_batch_max_tokens=256", "checkpoint.save_every=100", "optim.lr=1e-3", "optim.adam_eps=1e-3",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}", *extra,
    ]


def _train(overrides: list[str]) -> list[dict]:
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    assert run_training(cfg) == 0
    lines = (Path(cfg.logging.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_tp2_and_pp2_reproduce_tp1(tmp_path):
    ref = run_on_ranks(_train, 1, args=(_overrides(str(tmp_path / "tp1")),))[0]
    assert len(ref) == 3
    for key in REQUIRED_KEYS + [f"experience/bucket_{k}" for k in range(5)]:
        assert key in ref[0], key
    assert ref[0]["response_length/mean"] > 0 and ref[0]["entropy/mean"] > 0
    assert 0.999 < ref[0]["mismatch/token_mult_prob_error"] < 1.001  # sampler and trainer agree
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        got = run_on_ranks(_train, 2, args=(_overrides(str(tmp_path / name), tp, pp),))[0]
        for r, g in zip(ref, got, strict=True):
            for key in COMPARED:
                assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), (name, r["step"], key)


def test_malformed_rows_are_reported_and_skipped(tmp_path, caplog):
    rows = [{"prompt": "1+1=?", "reward_model": {"ground_truth": "2"}},
            {"prompt": "2+2=?"},  # no answer
            "not json",
            {"prompt": "3+4=?", "reward_model": {"ground_truth": "7"}}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.training.components import build_datasets

    cfg = load_config("demo_cpu", ["data.source=files", f"data.train_files=[{path}]", "data.template=plain"])
    train, _ = build_datasets(cfg, load_tokenizer("char"))
    assert train.qids() == [0, 3]
    assert [row for _, row, _ in train.malformed] == [1, 2]
