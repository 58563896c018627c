"""The algorithm variants by name: `algo.name` -> the class implementing `protocol.RLAlgorithm`.

Built-in variants are the modules of algo/variants/, each registering its class with `@register("name")`;
they are imported on first lookup, so a new variant is one new file there. `algo.name` may instead be a path
"package.module:Class" to a class outside this package (it need not register itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar, cast

from exgrpo_megatron.algo.protocol import RLAlgorithm
from exgrpo_megatron.algo.settings import read_settings, setting_keys, settings_classes, settings_errors
from exgrpo_megatron.algo.surrogates import surrogate_class, surrogate_names
from exgrpo_megatron.config.schema import AlgoConfig, TrainerConfig
from exgrpo_megatron.config.validate import ConfigError, algo_key_errors, algo_key_notes

_REGISTRY: dict[str, type[RLAlgorithm]] = {}
T = TypeVar("T", bound=type)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: select the class with `algo.name=<name>`."""
    def add(cls: T) -> T:
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"algorithm name {name!r} is registered twice ({_REGISTRY[name].__name__}, "
                             f"{cls.__name__})")
        _REGISTRY[name] = cast(type[RLAlgorithm], cls)
        return cls
    return add


def _import_builtin_variants() -> None:
    from exgrpo_megatron.algo import variants

    variants.import_all()


def registered_names() -> list[str]:
    _import_builtin_variants()
    return sorted(_REGISTRY)


def algorithm_class(name: str) -> type[RLAlgorithm]:
    """The class `algo.name` selects; ValueError with the reason when there is none."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {name!r} ({type(exc).__name__}: {exc})") from None
    else:
        _import_builtin_variants()
        if name not in _REGISTRY:
            raise ValueError(f"expected one of {registered_names()} or a path package.module:Class, got {name!r}")
        cls = _REGISTRY[name]
    if not isinstance(cls, type) or not hasattr(cls, "from_config"):
        raise ValueError(f"{name!r} is not an algorithm class (no from_config; see algo/protocol.py)")
    return cast(type[RLAlgorithm], cls)


def _selected_class(a: AlgoConfig) -> type[RLAlgorithm]:
    try:
        return algorithm_class(a.name)
    except ValueError as exc:
        raise ConfigError([f"algo.name: {exc}"]) from None


def _declares_keys(cls: type) -> bool:
    """Does the class declare the algo.* keys it reads (`GroupRelative.algo_keys_read` and the rest)? A class
    outside the package need not; its keys are then not checked."""
    return all(hasattr(cls, name) for name in ("algo_keys_read", "fixed_algo_keys", "unused_algo_keys",
                                               "config_errors"))


def algorithm_notes(a: AlgoConfig) -> list[str]:
    """What the start-up block says about the config for the selected variant: keys it overrides or leaves unused
    (config/validate.py `algo_key_notes`)."""
    cls = cast(Any, _selected_class(a))
    if not _declares_keys(cls):
        return []
    return algo_key_notes(a, cls.fixed_algo_keys, _unused(cls, a))


def settings_in_effect(a: AlgoConfig) -> dict[str, Any]:
    """The selected variant's settings (algo/settings.py) with the values it trains with: those set, and the declared
    defaults of the others (the start-up block shows them). Assumes `build_algorithm` accepted the config."""
    cls = cast(Any, _selected_class(a))
    classes = settings_classes(cls, a) if _declares_keys(cls) else ()
    return {f.name: getattr(settings, f.name) for settings in (read_settings(c, a) for c in classes)
            for f in fields(settings)}


def _unused(variant: Any, a: AlgoConfig) -> dict[str, str]:
    """The variant's keys unused on purpose, less those it reads after all (a subclass may read one)."""
    read = variant.algo_keys_read(a)
    return {key: why for key, why in variant.unused_algo_keys.items() if key not in read}


def _settings_owners() -> dict[str, str]:
    """Every declared setting's key -> who declares it (for the message refusing it to another variant)."""
    owners: dict[str, str] = {}
    for name in surrogate_names():
        for key in setting_keys(settings_classes(surrogate_class(name), AlgoConfig())):
            owners.setdefault(key, f"the {name} surrogate")
    for name in registered_names():
        own = getattr(_REGISTRY[name], "settings_class", None)
        for key in setting_keys((own,) if own is not None else ()):
            owners.setdefault(key, f"algo.name={name}")
    return owners


def build_algorithm(a: AlgoConfig, t: TrainerConfig, max_response_length: int) -> RLAlgorithm:
    """The algorithm `algo.name` selects, built from the config values it reads; ConfigError naming algo.name
    when it names none, naming every algo.* key set that the variant does not read, the variant's own relation
    errors and every `algo.settings.<key>` it does not define or gets wrong (algo/settings.py; the training CLI
    exits 2 before building anything else)."""
    cls = _selected_class(a)
    if _declares_keys(cls):
        variant = cast(Any, cls)
        errors = algo_key_errors(a, variant.algo_keys_read(a), variant.fixed_algo_keys, _unused(variant, a))
        errors += variant.config_errors(a)
        errors += settings_errors(a, settings_classes(variant, a), _settings_owners())
        if errors:
            raise ConfigError(errors)
    algorithm = cls.from_config(a.name, a, t, max_response_length)
    if not isinstance(algorithm, RLAlgorithm):
        raise ConfigError([f"algo.name: {a.name!r} does not implement the RLAlgorithm protocol (algo/protocol.py)"])
    return algorithm
