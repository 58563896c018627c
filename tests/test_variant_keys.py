"""Each variant declares the algo.* keys it reads (`algo_keys_read`), fixes (`fixed_algo_keys`) or leaves unused
on purpose (`unused_algo_keys`); a key set for a variant that does not read it is refused at start-up (exit 2,
naming it), a fixed key the config asks otherwise and an unused key set are said at start-up. The declarations are
true: `from_config` reads exactly the declared keys. Also: the entropy reference scales the bonus of the variants
that ask for it in their own class (ExGRPO; GRPO, the paper's baseline) and of no variant built on them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from exgrpo_megatron.algo.registry import algorithm_class, algorithm_notes, build_algorithm, registered_names
from exgrpo_megatron.algo.variants.cispo import CISPOWeight
from exgrpo_megatron.algo.variants.grpo import GRPO
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.schema import AlgoConfig
from exgrpo_megatron.config.validate import TRAINER_ALGO_KEYS, ConfigError, all_errors


def _build(*overrides: str):
    cfg = load_config("demo_cpu", list(overrides))
    return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)


def _refused_keys(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _build(*overrides)
    return [e.split(":", 1)[0] for e in err.value.errors]


def test_a_variant_without_replay_refuses_the_replay_keys_by_name():
    """gspo with ExGRPO's truncated-IS cap: not the policy-shaping relation (ExGRPO's own), but the setting itself;
    following the old hint (policy_shaping=false) does not make it silently ignored. The flat names of before map to
    ExGRPO's settings and are refused the same way."""
    cfg = load_config("demo_cpu", ["algo.name=gspo", "algo.settings.replay_tis_cap=2.0"])
    assert all_errors(cfg, 1, check_paths=False) == []  # no ExGRPO relation reported for a variant without replay
    assert _refused_keys("algo.name=gspo", "algo.settings.replay_tis_cap=2.0") == ["algo.settings.replay_tis_cap"]
    assert _refused_keys("algo.name=gspo", "algo.replay_tis_cap=2.0", "algo.policy_shaping=false") == [
        "algo.settings.replay_tis_cap", "algo.settings.policy_shaping"]
    assert _refused_keys("algo.name=grpo", "algo.settings.shaping_beta=0.2", "algo.mixed_phase_clip=true") == [
        "algo.settings.shaping_beta", "algo.settings.mixed_phase_clip"]


@pytest.mark.parametrize("overrides, key", [
    (("algo.name=cispo", "algo.clip_ratio=0.1"), "algo.clip_ratio"),  # CISPO's bounds are its own keys
    (("algo.name=grpo", "algo.settings.cispo_eps_high=1.0"), "algo.settings.cispo_eps_high"),
    (("algo.name=rloo", "algo.adv_std_normalize=true"), "algo.adv_std_normalize"),  # RLOO has no std division
    (("algo.name=grpo", "algo.surrogate=cispo"), "algo.surrogate"),  # only ExGRPO composes a surrogate by name
    (("algo.name=grpo", "algo.max_refill_rounds=5"), "algo.max_refill_rounds"),  # no group filter
    (("algo.name=exgrpo", "algo.settings.kl_coef=0.1"), "algo.settings.kl_coef"),  # the ppo_clip_kl surrogate's
    (("algo.name=exgrpo", "algo.surrogate=cispo", "algo.settings.kl_coef=0.1"), "algo.settings.kl_coef"),
    (("algo.name=grpo_kl", "algo.settings.cispo_eps_low=0.1"), "algo.settings.cispo_eps_low"),  # CISPO's
    (("algo.name=cispo", "algo.settings.eps_high=0.3"), "algo.settings.eps_high"),  # defined by no variant
    (("algo.name=cispo", "algo.settings.cispo_eps_high=wide"), "algo.settings.cispo_eps_high"),  # a wrong type
    (("algo.name=cispo", "algo.settings.cispo_eps_high=0"), "algo.settings.cispo_eps_high"),  # out of its range
])
def test_a_key_the_variant_does_not_read_is_refused(overrides, key):
    assert _refused_keys(*overrides) == [key]


def test_the_same_keys_are_accepted_where_they_are_read():
    kl = _build("algo.name=exgrpo", "algo.surrogate=ppo_clip_kl", "algo.settings.kl_coef=0.1").surrogate
    assert kl.kl_coef == 0.1
    assert _build("algo.name=dapo", "algo.max_refill_rounds=5").filters_groups
    cispo = _build("algo.name=exgrpo", "algo.surrogate=cispo", "algo.settings.cispo_eps_high=1.0").surrogate
    assert cispo.eps_high == 1.0
    assert _build("algo.name=cispo", "algo.settings.cispo_eps_low=null").surrogate.eps_low is None
    assert _build("algo.name=cispo", "algo.settings.cispo_eps_high=1").surrogate.eps_high == 1.0  # int -> float
    assert _refused_keys("algo.name=exgrpo", "algo.surrogate=no_such") == ["algo.surrogate"]


def test_a_fixed_or_unused_key_is_said_at_start_up():
    """GSPO fixes its aggregation: the run says so when the config asks for another (and builds seq_mean); the
    entropy reference is ExGRPO's: set for GRPO (the demo preset sets 1) it is named as unused."""
    cfg = load_config("demo_cpu", ["algo.name=gspo", "algo.loss_agg_mode=token_mean"])
    assert build_algorithm(cfg.algo, cfg.trainer, 8).loss_agg_mode == "seq_mean"
    notes = algorithm_notes(cfg.algo)
    assert any(n.startswith("algo.loss_agg_mode='token_mean' is overridden: algo.name=gspo takes 'seq_mean'")
               for n in notes), notes
    assert any(n.startswith("algo.entropy_microbatches_ref=1.0 is not used by algo.name=gspo") for n in notes), notes
    assert algorithm_notes(load_config("demo_cpu", ["algo.name=exgrpo"]).algo) == []
    assert algorithm_notes(load_config("demo_cpu", ["algo.name=cispo", "algo.loss_agg_mode=token_mean",
                                                    "algo.entropy_microbatches_ref=4"]).algo) == []


@pytest.mark.parametrize("name", registered_names())
@pytest.mark.parametrize("surrogate", ["ppo_clip", "cispo", "ppo_clip_kl"])
def test_from_config_reads_exactly_the_declared_keys(name, surrogate):
    """A recording config: the keys `from_config` reads are the variant's declaration, and nothing else."""
    cfg = load_config("demo_cpu", [f"algo.name={name}"])
    algo = AlgoConfig(**{**{f.name: getattr(cfg.algo, f.name) for f in fields(AlgoConfig)}, "surrogate": surrogate})
    read: set[str] = set()

    class Recording:
        def __getattr__(self, key: str):
            read.add(key)
            return getattr(algo, key)

    cls = algorithm_class(name)
    cls.from_config(name, Recording(), cfg.trainer, 8)  # type: ignore[arg-type]
    declared = cls.algo_keys_read(algo) - {"max_refill_rounds"}  # type: ignore[attr-defined]
    # (a filtering variant declares algo.max_refill_rounds: the trainer's refill reads it, rollout/group_filter.py)
    assert read - TRAINER_ALGO_KEYS == declared, (read ^ declared)


def test_the_entropy_reference_scales_only_the_variants_that_ask_for_it():
    """algo.entropy_microbatches_ref is the original code's micro-batch count: ExGRPO's and GRPO's entropy normaliser
    is the token count / it; a variant built on GRPO (which does not ask in its own class) has the token count."""
    for name in ("exgrpo", "grpo", "rloo", "dapo", "gspo", "cispo", "grpo_kl", f"{__name__}:GRPOSubclass"):
        algo = _build(f"algo.name={name}", "algo.entropy_microbatches_ref=4")
        assert algo.normalisers(100.0, 10.0)[1] == (25.0 if name in ("exgrpo", "grpo") else 100.0), name
        notes = algorithm_notes(load_config("demo_cpu", [f"algo.name={name}"]).algo)  # the preset sets 1
        assert [n.split("=")[0] for n in notes] == ([] if name in ("exgrpo", "grpo")
                                                    else ["algo.entropy_microbatches_ref"]), (name, notes)


@dataclass(frozen=True)
class GRPOSubclass(GRPO):
    """A newcomer's variant on GRPO: it does not ask for the entropy reference."""


def test_cli_exits_2_naming_the_replay_key_for_gspo():
    proc = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu",
                           "algo.name=gspo", "algo.settings.replay_tis_cap=2.0", "algo.settings.policy_shaping=false"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "algo.settings.replay_tis_cap: 2.0 is not read by algo.name=gspo" in proc.stderr, proc.stderr[-2000:]
    assert "algo.settings.policy_shaping: False is not read by algo.name=gspo" in proc.stderr, proc.stderr[-2000:]


def test_settings_keep_their_declared_defaults_and_old_flat_names_map_with_a_notice(capsys):
    """No algo.settings in the config: each settings class's defaults (declared in the variant's file). The flat
    names of before (algo.cispo_eps_*, algo.kl_coef, ExGRPO's algo.shaping_beta, ...) map to algo.settings.* with a
    notice, on the command line and in a preset."""
    assert _build("algo.name=cispo").surrogate == CISPOWeight(None, 0.28)
    assert _build("algo.name=grpo_kl").surrogate.kl_coef == 0.04
    assert load_config("demo_cpu").algo.settings == {}
    capsys.readouterr()
    assert _build("algo.name=cispo", "algo.cispo_eps_low=0.1", "algo.cispo_eps_high=0.5").surrogate == CISPOWeight(
        0.1, 0.5)
    assert _build("algo.name=grpo_kl", "algo.kl_coef=0.3").surrogate.kl_coef == 0.3
    exgrpo = _build("algo.name=exgrpo", "algo.shaping_beta=0.3", "algo.mixed_phase_clip=true")
    assert (exgrpo.shaping_beta, exgrpo.mixed_phase_clip, exgrpo.policy_shaping) == (0.3, True, True)
    err = capsys.readouterr().err
    for old in ("algo.cispo_eps_low", "algo.cispo_eps_high", "algo.kl_coef", "algo.shaping_beta",
                "algo.mixed_phase_clip"):
        assert f"{old} is now algo.settings.{old.split('.')[1]} (the old name is accepted" in err, err


def test_a_settings_key_in_a_preset_and_its_old_flat_name_there(tmp_path, capsys):
    """A preset may set algo.settings; the command line replaces a key or adds one without `+`. A preset with an old
    flat name maps it too."""
    conf = tmp_path / "conf"
    shutil.copytree(Path(__file__).resolve().parents[1] / "conf", conf)
    text = (conf / "demo_cpu.yaml").read_text()
    (conf / "cispo_set.yaml").write_text(text.replace("algo:\n", "algo:\n  settings: {cispo_eps_high: 0.5}\n", 1))
    (conf / "cispo_flat.yaml").write_text(text.replace("algo:\n", "algo:\n  cispo_eps_high: 0.6\n", 1))
    assert load_config("cispo_set", [], config_dir=conf).algo.settings == {"cispo_eps_high": 0.5}
    assert load_config("cispo_set", ["algo.settings.cispo_eps_high=0.7", "algo.settings.cispo_eps_low=0.1"],
                       config_dir=conf).algo.settings == {"cispo_eps_high": 0.7, "cispo_eps_low": 0.1}
    assert load_config("cispo_flat", [], config_dir=conf).algo.settings == {"cispo_eps_high": 0.6}
    assert "algo.cispo_eps_high is now algo.settings.cispo_eps_high" in capsys.readouterr().err


def test_cli_exits_2_naming_a_settings_key_the_variant_does_not_define():
    proc = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu",
                           "algo.name=grpo", "algo.settings.kl_coef=0.1", "algo.settings.no_such_key=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("algo.settings.kl_coef: 0.1 is not read by algo.name=grpo (a setting of the ppo_clip_kl surrogate"
            in proc.stderr), proc.stderr[-2000:]
    assert "algo.settings.no_such_key: 1 is not read by algo.name=grpo (no variant or surrogate defines it" in (
        proc.stderr), proc.stderr[-2000:]
