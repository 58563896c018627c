"""Config composition and start-up validation: bad values fail naming the key and the reason."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate
from exgrpo_megatron.model.builder import transformer_engine_available


def _errors(name: str, overrides: list[str], world_size: int = 8) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(name, overrides), world_size)
    return str(info.value)


def test_overrides_apply_and_defaults_follow_the_paper():
    cfg = load_config("exgrpo_7b", ["trainer.experience_ratio=0.25", "++parallel.tensor_model_parallel_size=4"])
    assert cfg.trainer.experience_ratio == 0.25
    assert cfg.parallel.tensor_model_parallel_size == 4
    assert (cfg.rollout.n, cfg.optim.lr, cfg.algo.shaping_beta, cfg.algo.entropy_coeff) == (8, 1e-6, 0.1, 0.001)
    assert (cfg.trainer.experience_start_sratio, cfg.trainer.experience_rbound, cfg.trainer.total_steps) == (
        0.35, 7, 701)
    validate(cfg, 8, check_paths=False)  # the preset's model and data are not on this machine


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["++parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
        (["model.num_query_groups=3"], "model.num_query_groups"),
        (["trainer.experience_ratio=1.0"], "trainer.experience_ratio"),
        (["trainer.experience_ratio=-0.1"], "trainer.experience_ratio"),
        (["reward.timeout_seconds=1.5"], "reward.timeout_seconds"),
        (["reward.timeout_seconds=0"], "reward.timeout_seconds"),
        (["+trainer.no_such_key=1"], "trainer.no_such_key"),
        (["trainer.no_such_key=1"], "trainer.no_such_key"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["algo.loss_agg_mode=seq_mean"], "algo.loss_agg_mode"),
        (["trainer.experience_rbound=8"], "trainer.experience_rbound"),
        (["++parallel.pipeline_model_parallel_size=1", "++parallel.virtual_pipeline_model_parallel_size=2"],
         "parallel.virtual_pipeline_model_parallel_size"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    assert key in _errors("exgrpo_7b", overrides)


def test_world_size_must_divide_by_model_parallel():
    assert "world size 5 is not divisible" in _errors("exgrpo_7b", [], world_size=5)


def test_cli_exits_2_with_the_key_before_building_anything():
    proc = subprocess.run(
        [sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu", "trainer.experience_ratio=2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "trainer.experience_ratio" in proc.stderr


def test_transformer_engine_is_absent_on_cpu():
    # A half-installed TE raises RuntimeError through megatron's `except ImportError` guards.
    assert importlib.util.find_spec("transformer_engine") is None
    assert transformer_engine_available() is False
    from exgrpo_megatron.model.builder import resolve_layer_spec

    assert resolve_layer_spec(load_config("demo_cpu").model) == "local"
