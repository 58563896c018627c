"""A few training steps of a tiny warm-started demo run, reduced to what must not change when the code is
refactored: every logged metric except timings (exact floats) and a sha256 of the final weights.

    python -m tests.helpers.demo_digest OUT.json   # records the reference arms (run on the reference code)

tests/test_demo_bitwise.py compares today's code against the values recorded this way on the code before the
algorithm protocol (tests/fixtures/demo_digest_reference_<cpu>.json, one per kind of CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from exgrpo_megatron.config.loader import load_config

SFT_STEPS = 150
# (name, DP size, extra overrides): ExGRPO with replays (mixed from step 2), ExGRPO on 2 DP ranks, on-policy GRPO.
ARMS: list[tuple[str, int, tuple[str, ...]]] = [
    ("exgrpo_dp1", 1, ()),
    ("exgrpo_dp2", 2, ()),
    ("grpo_dp1", 1, ("algo.name=grpo",)),
]


def overrides(run_dir: str, sft_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The arms' overrides; trainer.experience_start_sratio and trainer.experience_rbound are the old names of
    trainer.delayed_start_pass_rate and trainer.replayable_correct_at_most, kept so that this helper runs unchanged on
    the reference commit (config/aliases.py maps them)."""
    return [
        "model=tiny_qwen2", "model.vocab_size=103", f"logging.run_dir={run_dir}", "logging.tensorboard=false",
        "logging.progress_bar=false", "trainer.total_steps=4", "trainer.train_batch_size=16",
        "trainer.ppo_mini_batch_size=8", "rollout.n=4", "trainer.experience_rbound=3",
        "trainer.experience_start_sratio=0", f"trainer.sft_warm_start_steps={SFT_STEPS}",
        "trainer.sft_warm_start_lr=5e-3", f"trainer.sft_cache_dir={sft_dir}", "trainer.val_every=0",
        "data.max_response_length=32", "data.num_train_examples=512", "trainer.micro_batch_max_tokens=256",
        "checkpoint.save_every=100", "optim.lr=1e-3", "optim.adam_eps=1e-3", *extra,
    ]


def weights_sha256(policy) -> str:
    h = hashlib.sha256()
    for module in policy.modules:
        for name, p in sorted(module.state_dict().items()):
            if hasattr(p, "detach"):
                h.update(name.encode())
                h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_digest(overrides_: list[str]) -> dict | None:
    """run_training on this rank; rank 0 returns {"metrics": [...], "weights": sha256}."""
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    kept: dict = {}

    class KeepComponents(StepObserver):
        def started(self, c) -> None:
            kept["c"] = c

    cfg = load_config("demo_cpu", overrides_)
    assert run_training(cfg, observers=[KeepComponents()]) == 0
    if kept["c"].layout.rank != 0:
        return None
    with open(os.path.join(cfg.logging.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    metrics = [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/")) and k != "timestamp"}
               for r in rows]
    return {"metrics": metrics, "weights": weights_sha256(kept["c"].policy)}


def warm_start(overrides_: list[str]) -> None:
    from exgrpo_megatron.data.tokenizer import load_tokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.warm_start import warm_start_weights

    cfg = load_config("demo_cpu", overrides_)
    init_distributed(seed=cfg.seed)
    warm_start_weights(cfg, load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path))


def digest_arms(tmp: str, sft: str | None = None) -> dict[str, dict]:
    """Each arm's digest; `sft` is a warm-start cache directory to use (default: a new one under `tmp`)."""
    from tests.helpers.multirank import run_on_ranks

    sft = sft or os.path.join(tmp, "sft")
    run_on_ranks(warm_start, 1, args=(overrides(os.path.join(tmp, "unused"), sft,
                                                ("trainer.micro_batch_max_tokens=8192",)),))
    out = {}
    for name, dp, extra in ARMS:
        out[name] = run_on_ranks(train_digest, dp, args=(overrides(os.path.join(tmp, name), sft, extra),))[0]
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        result = digest_arms(d)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
