"""A short training run of a tiny model warm-started until some answers are correct, so the experience pool fills:
its overrides, its supervised warm start (trained once per test session, cached) and its logged metrics."""

from __future__ import annotations

import os

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks
from tests.test_trainer import _overrides

STEPS, BATCH = 5, 16


def replay_overrides(run_dir: str, sft_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    return _overrides(run_dir, extra=(
        "trainer.sft_warm_start_steps=150", "trainer.sft_warm_start_lr=5e-3", f"trainer.sft_cache_dir={sft_dir}",
        "data.num_train_examples=512", "data.max_response_length=32", f"trainer.total_steps={STEPS}",
        f"trainer.train_batch_size={BATCH}", f"trainer.ppo_mini_batch_size={BATCH // 2}", *extra))


def _warm_start(overrides: list[str]) -> None:
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.warm_start import warm_start_weights

    cfg = load_config("demo_cpu", overrides)
    init_distributed(seed=cfg.seed)
    warm_start_weights(cfg, load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))


def train_warm_start(tmp_path_factory, sft_cache_dir: str) -> str:
    """The warm-start weights, trained once (the cache key ignores the run dir, the layout and the
    micro-batch budget: one micro-batch per supervised step here, the same gradient, less overhead)."""
    unused = str(tmp_path_factory.mktemp("unused"))
    extra = ("trainer.micro_batch_max_tokens=8192",)
    run_on_ranks(_warm_start, 1, args=(replay_overrides(unused, sft_cache_dir, extra),))
    return sft_cache_dir


def run_metrics(run_dir: str) -> list[dict]:
    from exgrpo_megatron.logging import read_metrics

    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))
