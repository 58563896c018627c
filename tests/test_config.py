"""Config composition and start-up validation: bad values fail naming the key and the reason."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

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
    assert (cfg.trainer.delayed_start_pass_rate, cfg.trainer.replayable_correct_at_most, cfg.trainer.total_steps) == (
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
        (["algo.loss_agg_mode=sequence_sum"], "algo.loss_agg_mode"),
        (["algo.ratio=group"], "algo.ratio"),
        (["algo.clip_ratio_high=0"], "algo.clip_ratio_high"),
        (["trainer.replayable_correct_at_most=8"], "trainer.replayable_correct_at_most"),
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


@pytest.mark.parametrize("old, new, value", [
    ("algo.exp_is_correct", "algo.replay_is_correction", False),
    ("trainer.experience_start_sratio", "trainer.delayed_start_pass_rate", 0.125),
    ("trainer.experience_lbound", "trainer.replayable_correct_above", 1),
    ("trainer.experience_rbound", "trainer.replayable_correct_at_most", 5),
])
def test_a_renamed_key_is_accepted_under_its_old_name_with_a_notice(old, new, value, capsys):
    literal = str(value).lower() if isinstance(value, bool) else str(value)
    cfg = load_config("demo_cpu", [f"{old}={literal}"])
    group, leaf = new.split(".")
    assert getattr(getattr(cfg, group), leaf) == value
    assert f"{old} is now {new}" in capsys.readouterr().err


def test_a_renamed_key_in_a_config_file_is_accepted(tmp_path, capsys):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(Path(__file__).resolve().parents[1] / "conf", conf)
    text = (conf / "demo_cpu.yaml").read_text().replace("trainer:\n", "trainer:\n  experience_start_sratio: 0.2\n", 1)
    (conf / "demo_cpu.yaml").write_text(text)
    assert load_config("demo_cpu", [], config_dir=conf).trainer.delayed_start_pass_rate == 0.2
    assert "trainer.experience_start_sratio is now trainer.delayed_start_pass_rate" in capsys.readouterr().err
