"""The benches' model shapes are valid model configs of today's schema (a renamed or moved field breaks a bench
at its start, which no other test runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exgrpo_megatron.config.schema import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("bench", ["rollout_throughput", "train_throughput"])
def test_every_bench_model_preset_is_a_model_config(bench):
    module = __import__(bench)
    for name, fields in module.PRESETS.items():
        assert ModelConfig(**fields).num_layers == fields["num_layers"], (bench, name)


def test_the_decode_profile_builds_the_smollm2_shape():
    import decode_profile

    assert ModelConfig(**decode_profile.SMOLLM2).family == "llama"
