"""A run that trains its supervised warm-start entry and a run that loads the same entry from the cache leave every
RNG stream (python, numpy, torch CPU, megatron's trackers) in the same state, so their later checkpoints hold the same
RNG state (the training builds and trains a model of its own, which draws from the global streams).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_warm_start_rng.py -x
"""

from __future__ import annotations

from tests.helpers.multirank import run_on_ranks
from tests.test_resume_integrity import TINY


def rng_after_warm_start(cache: str) -> dict:
    import torch

    from exgrpo_megatron.checkpoint.rng_io import capture_rng_scalars, capture_rng_tensors, restore_rng_streams
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.warm_start import warm_start_weights

    def state() -> tuple[dict, dict]:
        return {k: v.clone() for k, v in capture_rng_tensors().items()}, capture_rng_scalars()

    def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> list[str]:
        differ = [k for k in a[0] if not torch.equal(a[0][k], b[0][k])]
        return differ + [k for k in a[1] if a[1][k] != b[1][k]]

    cfg = load_config("demo_cpu", [*TINY, "trainer.sft_warm_start_steps=2", f"trainer.sft_cache_dir={cache}",
                                   "data.num_train_examples=32"])
    init_distributed(1, 1, seed=cfg.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    before = state()
    warm_start_weights(cfg, tokenizer)  # trains the entry
    trained = state()
    restore_rng_streams(*before)  # the loading run starts from the same state
    warm_start_weights(cfg, tokenizer)  # loads the entry
    loaded = state()
    return {"trained_vs_before": same(before, trained), "loaded_vs_trained": same(trained, loaded)}


def test_training_or_loading_the_warm_start_entry_leaves_the_same_rng_state(tmp_path):
    got = run_on_ranks(rng_after_warm_start, 1, args=(str(tmp_path / "sft"),))[0]
    assert got["trained_vs_before"] == [], got  # old code: ["torch_cpu"]
    assert got["loaded_vs_trained"] == [], got
