"""Config keys that were renamed: the old name is accepted for one release and maps to the new one, with a notice
on stderr naming the new key. The one table of renamed keys (`RENAMED_KEYS`, old -> new); `load_config` applies it
to the command-line overrides (before composing) and to the composed config (a preset or config file that still
uses an old name)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf, open_dict

RENAMED_KEYS: dict[str, str] = {
    "algo.exp_is_correct": "algo.settings.replay_is_correction",
    "trainer.experience_start_sratio": "experience.delayed_start_pass_rate",
    "trainer.experience_lbound": "experience.admit_correct_above",
    "trainer.experience_rbound": "experience.admit_correct_at_most",
    # the pool's settings moved from trainer.* into their own group (conf/experience/)
    "trainer.experience_ratio": "experience.ratio",
    "trainer.delayed_start_pass_rate": "experience.delayed_start_pass_rate",
    "trainer.replayable_correct_above": "experience.admit_correct_above",
    "trainer.replayable_correct_at_most": "experience.admit_correct_at_most",
    "trainer.exp_metric": "experience.metric",
    "trainer.exp_bucket_manager": "experience.bucket_manager",
    "trainer.exp_bucket_mu": "experience.bucket_mu",
    "trainer.exp_bucket_sigma": "experience.bucket_sigma",
    "trainer.exp_max_trajectories_per_question": "experience.max_trajectories_per_question",
    "trainer.exp_select_mode": "experience.select_mode",
    # a variant's own settings moved into its file (algo/settings.py): algo.settings.<key>
    "algo.cispo_eps_low": "algo.settings.cispo_eps_low",
    "algo.cispo_eps_high": "algo.settings.cispo_eps_high",
    "algo.kl_coef": "algo.settings.kl_coef",
    "algo.shaping_beta": "algo.settings.shaping_beta",
    "algo.policy_shaping": "algo.settings.policy_shaping",
    "algo.replay_is_correction": "algo.settings.replay_is_correction",
    "algo.replay_tis_cap": "algo.settings.replay_tis_cap",
    "algo.mixed_phase_clip": "algo.settings.mixed_phase_clip",
}
_OVERRIDE_PREFIXES = ("++", "+", "~")


def _notice(old: str, new: str) -> None:
    print(f"exgrpo config: {old} is now {new} (the old name is accepted for one release)", file=sys.stderr)


def rename_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides with renamed keys written under their new names."""
    out = []
    for item in overrides:
        prefix = next((p for p in _OVERRIDE_PREFIXES if item.startswith(p)), "")
        key, sep, value = item[len(prefix):].partition("=")
        if key in RENAMED_KEYS:
            _notice(key, RENAMED_KEYS[key])
            item = f"{prefix}{RENAMED_KEYS[key]}{sep}{value}"
        out.append(item)
    return out


def rename_composed(cfg: DictConfig) -> DictConfig:
    """Move a value found under an old key to the new key. No file in conf/ uses an old name, so an old key was
    set on purpose: its value replaces the new key's."""
    for old, new in RENAMED_KEYS.items():
        group, _, leaf = old.rpartition(".")
        node = OmegaConf.select(cfg, group)
        if not isinstance(node, DictConfig) or leaf not in node:
            continue
        _notice(old, new)
        with open_dict(node):
            value = node.pop(leaf)
            OmegaConf.update(cfg, new, value, force_add=True)
    return cfg
