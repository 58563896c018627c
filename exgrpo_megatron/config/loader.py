"""Compose a run configuration with Hydra (NeMo-style overrides) and check it against the schema.

    cfg = load_config("exgrpo_7b", ["experience.ratio=0.25", "++parallel.tensor_model_parallel_size=4"])

Hydra's override grammar applies (`key=value`, `+new=value`, `++key=value`, `~key`). The composed
YAML is merged into the typed `RootConfig`: an unknown key or a value of the wrong type fails here
with the full key; `validate()` then checks the relations between keys. Renamed keys are accepted under their
old names for one release (config/aliases.py). A variant's own settings (`algo.settings.<key>`, algo/settings.py)
take no `+`: `free_form_overrides` adds it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from exgrpo_megatron.config.aliases import rename_composed, rename_overrides
from exgrpo_megatron.config.families import pop_retired_qkv_bias
from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.config.validate import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose(config_name: str, overrides: list[str] | None = None, config_dir: Path | str | None = None) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    config_dir = Path(config_dir or CONF_DIR).resolve()
    available = presets(config_dir)
    if config_name.removesuffix(".yaml") not in available:
        raise ConfigError([f"--config-name: {config_name!r} is not a preset in {config_dir}; available: "
                           f"{', '.join(available) or '(none)'}"])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            composed = hydra_compose(config_name=config_name,
                                     overrides=free_form_overrides(rename_overrides(list(overrides or []))))
            return rename_composed(composed)
    except (HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__
        key = getattr(cause, "full_key", None) or getattr(exc, "full_key", None)
        lines = [line.strip() for line in str(exc).split("Config search path:")[0].splitlines() if line.strip()]
        if isinstance(exc, MissingConfigException):  # a group option: Hydra lists the available ones, one a line
            message = f"{lines[0]} {lines[1]} {', '.join(lines[2:])}" if len(lines) > 2 else " ".join(lines)
        else:
            message = " ".join(lines[:2])
        raise ConfigError([f"{key or config_name}: {message}"]) from None
    finally:
        GlobalHydra.instance().clear()


# The free-form mappings of the config: their keys are not in conf/, so an override adds or replaces one (`++`)
FREE_FORM_PREFIXES = ("algo.settings.",)


def free_form_overrides(overrides: list[str]) -> list[str]:
    """`algo.settings.<key>=value` written as `++algo.settings.<key>=value`: a variant's setting is set on the
    command line without `+` (algo/settings.py checks the key against the variant at start-up)."""
    return [f"++{item}" if item.startswith(FREE_FORM_PREFIXES) else item for item in overrides]


def presets(config_dir: Path | str | None = None) -> list[str]:
    """The names `--config-name` accepts: the top-level YAML files of the config directory."""
    path = Path(config_dir or CONF_DIR)
    return sorted(p.stem for p in path.glob("*.yaml")) if path.is_dir() else []


def to_schema(composed: DictConfig) -> RootConfig:
    """Merge into the typed schema; unknown keys and wrong types raise ConfigError naming the key."""
    model = composed.get("model")
    if isinstance(model, DictConfig) and "qkv_bias" in model:  # a run config written before the family decided it
        try:
            with open_dict(model):
                pop_retired_qkv_bias(model, "model.qkv_bias")
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), composed)
        cfg = OmegaConf.to_object(merged)
        assert isinstance(cfg, RootConfig)
        return cfg
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(exc).splitlines()[0]
        raise ConfigError([f"{key}: {reason}"]) from None


def load_config(config_name: str, overrides: list[str] | None = None,
                config_dir: Path | str | None = None) -> RootConfig:
    return to_schema(compose(config_name, overrides, config_dir))


def to_yaml(cfg: RootConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
