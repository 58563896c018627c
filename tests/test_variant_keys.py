"""Each variant declares the algo.* keys it reads (`algo_keys_read`), fixes (`fixed_algo_keys`) or leaves unused
on purpose (`unused_algo_keys`); a key set for a variant that does not read it is refused at start-up (exit 2,
naming it), a fixed key the config asks otherwise and an unused key set are said at start-up. The declarations are
true: `from_config` reads exactly the declared keys. Also: the entropy reference scales the bonus of the variants
that ask for it in their own class (ExGRPO; GRPO, the paper's baseline) and of no variant built on them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, fields

import pytest

from exgrpo_megatron.algo.registry import algorithm_class, algorithm_notes, build_algorithm, registered_names
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
    """gspo with the truncated-IS cap: not the policy-shaping relation (ExGRPO's own), but the key itself; following
    the old hint (policy_shaping=false) does not make it silently ignored."""
    cfg = load_config("demo_cpu", ["algo.name=gspo", "algo.replay_tis_cap=2.0"])
    assert all_errors(cfg, 1, check_paths=False) == []  # no ExGRPO relation reported for a variant without replay
    assert _refused_keys("algo.name=gspo", "algo.replay_tis_cap=2.0") == ["algo.replay_tis_cap"]
    assert _refused_keys("algo.name=gspo", "algo.replay_tis_cap=2.0", "algo.policy_shaping=false") == [
        "algo.replay_tis_cap", "algo.policy_shaping"]
    assert _refused_keys("algo.name=grpo", "algo.shaping_beta=0.2", "algo.mixed_phase_clip=true") == [
        "algo.shaping_beta", "algo.mixed_phase_clip"]


@pytest.mark.parametrize("overrides, key", [
    (("algo.name=cispo", "algo.clip_ratio=0.1"), "algo.clip_ratio"),  # CISPO's bounds are its own keys
    (("algo.name=grpo", "algo.cispo_eps_high=1.0"), "algo.cispo_eps_high"),
    (("algo.name=rloo", "algo.adv_std_normalize=true"), "algo.adv_std_normalize"),  # RLOO has no std division
    (("algo.name=grpo", "algo.surrogate=cispo"), "algo.surrogate"),  # only ExGRPO composes a surrogate by name
    (("algo.name=grpo", "algo.max_refill_rounds=5"), "algo.max_refill_rounds"),  # no group filter
    (("algo.name=exgrpo", "algo.kl_coef=0.1"), "algo.kl_coef"),  # read by the ppo_clip_kl surrogate only
])
def test_a_key_the_variant_does_not_read_is_refused(overrides, key):
    assert _refused_keys(*overrides) == [key]


def test_the_same_keys_are_accepted_where_they_are_read():
    assert _build("algo.name=exgrpo", "algo.surrogate=ppo_clip_kl", "algo.kl_coef=0.1").surrogate.kl_coef == 0.1
    assert _build("algo.name=dapo", "algo.max_refill_rounds=5").filters_groups
    assert _build("algo.name=exgrpo", "algo.surrogate=cispo", "algo.cispo_eps_high=1.0").surrogate.eps_high == 1.0
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
                           "algo.name=gspo", "algo.replay_tis_cap=2.0", "algo.policy_shaping=false"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "algo.replay_tis_cap: 2.0 is not read by algo.name=gspo" in proc.stderr, proc.stderr[-2000:]
    assert "algo.policy_shaping: False is not read by algo.name=gspo" in proc.stderr, proc.stderr[-2000:]
