"""Config composition and start-up validation: bad values fail naming the key and the reason."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from exgrpo_megatron.algo.registry import settings_in_effect
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate
from exgrpo_megatron.machine.transformer_engine import transformer_engine_available


def _errors(name: str, overrides: list[str], world_size: int = 8) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(name, overrides), world_size)
    return str(info.value)


def test_overrides_apply_and_defaults_follow_the_paper():
    cfg = load_config("exgrpo_7b", ["experience.ratio=0.25", "++parallel.tensor_model_parallel_size=4"])
    assert cfg.experience.ratio == 0.25
    assert cfg.parallel.tensor_model_parallel_size == 4
    assert (cfg.rollout.n, cfg.optim.lr, cfg.algo.entropy_coeff) == (8, 1e-6, 0.001)
    assert settings_in_effect(cfg.algo)["shaping_beta"] == 0.1  # ExGRPO's own setting, at the paper's value
    assert (cfg.experience.delayed_start_pass_rate, cfg.experience.admit_correct_at_most, cfg.trainer.total_steps) == (
        0.35, 7, 701)
    validate(cfg, 8, check_paths=False)  # the preset's model and data are not on this machine


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["++parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
        (["model.num_query_groups=3"], "model.num_query_groups"),
        (["experience.ratio=1.0"], "experience.ratio"),
        (["experience.ratio=-0.1"], "experience.ratio"),
        (["reward.timeout_seconds=1.5"], "reward.timeout_seconds"),
        (["reward.timeout_seconds=0"], "reward.timeout_seconds"),
        (["+trainer.no_such_key=1"], "trainer.no_such_key"),
        (["trainer.no_such_key=1"], "trainer.no_such_key"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["algo.loss_agg_mode=sequence_sum"], "algo.loss_agg_mode"),
        (["algo.ratio=group"], "algo.ratio"),
        (["algo.clip_ratio_high=0"], "algo.clip_ratio_high"),
        (["experience.admit_correct_at_most=8"], "experience.admit_correct_at_most"),
        (["++parallel.pipeline_model_parallel_size=1", "++parallel.virtual_pipeline_model_parallel_size=2"],
         "parallel.virtual_pipeline_model_parallel_size"),
        (["data.max_unparsable_answers=1.5"], "data.max_unparsable_answers"),
        (["rollout.max_staleness=1", "algo.fresh_is_cap=2", "rollout.generator.deadline_factor=0"],
         "rollout.generator.deadline_factor"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    assert key in _errors("exgrpo_7b", overrides)


def test_world_size_must_divide_by_model_parallel():
    assert "world size 5 is not divisible" in _errors("exgrpo_7b", [], world_size=5)


def test_cli_exits_2_with_the_key_before_building_anything():
    proc = subprocess.run(
        [sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu", "experience.ratio=2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "experience.ratio" in proc.stderr


def test_transformer_engine_is_absent_on_cpu():
    # A half-installed TE raises RuntimeError through megatron's `except ImportError` guards.
    assert importlib.util.find_spec("transformer_engine") is None
    assert transformer_engine_available() is False
    from exgrpo_megatron.config.derived import resolve_layer_spec

    assert resolve_layer_spec(load_config("demo_cpu").model) == "local"


@pytest.mark.parametrize("old, new, value", [
    ("algo.exp_is_correct", "algo.settings.replay_is_correction", False),
    ("algo.replay_is_correction", "algo.settings.replay_is_correction", False),
    ("algo.shaping_beta", "algo.settings.shaping_beta", 0.2),
    ("algo.policy_shaping", "algo.settings.policy_shaping", False),
    ("algo.replay_tis_cap", "algo.settings.replay_tis_cap", 2.0),
    ("algo.mixed_phase_clip", "algo.settings.mixed_phase_clip", True),
    ("trainer.experience_start_sratio", "experience.delayed_start_pass_rate", 0.125),
    ("trainer.experience_lbound", "experience.admit_correct_above", 1),
    ("trainer.experience_rbound", "experience.admit_correct_at_most", 5),
    ("trainer.experience_ratio", "experience.ratio", 0.25),
    ("trainer.delayed_start_pass_rate", "experience.delayed_start_pass_rate", 0.125),
    ("trainer.replayable_correct_at_most", "experience.admit_correct_at_most", 5),
    ("trainer.exp_metric", "experience.metric", "random"),
    ("trainer.exp_bucket_manager", "experience.bucket_manager", "uniform"),
    ("trainer.exp_bucket_mu", "experience.bucket_mu", 0.25),
    ("trainer.exp_bucket_sigma", "experience.bucket_sigma", 1.5),
    ("trainer.exp_max_trajectories_per_question", "experience.max_trajectories_per_question", 3),
    ("trainer.exp_select_mode", "experience.select_mode", "argmax"),
])
def test_a_renamed_key_is_accepted_under_its_old_name_with_a_notice(old, new, value, capsys):
    literal = str(value).lower() if isinstance(value, bool) else str(value)
    cfg = load_config("demo_cpu", [f"{old}={literal}"])
    node: object = cfg
    for part in new.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    assert node == value
    assert f"{old} is now {new}" in capsys.readouterr().err


def test_a_renamed_key_in_a_config_file_is_accepted(tmp_path, capsys):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(Path(__file__).resolve().parents[1] / "conf", conf)
    text = (conf / "demo_cpu.yaml").read_text().replace("trainer:\n", "trainer:\n  experience_start_sratio: 0.2\n", 1)
    (conf / "demo_cpu.yaml").write_text(text)
    assert load_config("demo_cpu", [], config_dir=conf).experience.delayed_start_pass_rate == 0.2
    assert "trainer.experience_start_sratio is now experience.delayed_start_pass_rate" in capsys.readouterr().err


def test_an_unknown_preset_exits_2_listing_every_preset(capsys):
    from exgrpo_megatron.train import main as train_main

    assert train_main(["--config-name", "exgrpo_7", "--dry-run"]) == 2
    err = capsys.readouterr().err
    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf").glob("*.yaml"))
    assert "--config-name: 'exgrpo_7' is not a preset" in err
    assert f"available: {', '.join(presets)}" in err and "exgrpo_7b" in presets


def test_an_unknown_group_option_lists_the_group_s_options(capsys):
    from exgrpo_megatron.train import main as train_main

    assert train_main(["--config-name", "demo_cpu", "model=qwen3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Could not find 'model/qwen3'" in err and "demo_qwen2, " in err and "tiny_qwen2" in err
    assert "Config search path" not in err
