"""A variant's own settings: `algo.settings.<key>`, declared in the variant's file.

A variant with knobs that no other variant reads declares them as a frozen dataclass deriving from `VariantSettings`
in its own file: each field is a key (its type and default), `domains` gives each numeric key's range (a
config/domains.py `Domain`), `config_errors` the relations between its keys. The variant names the class as its
`settings_class`; a surrogate does the same (algo/surrogates.py), and a variant reads its surrogate's settings too
(ExGRPO with `algo.surrogate=cispo` reads CISPO's).

`algo.settings` is a free-form mapping of the config (conf/algo/exgrpo.yaml: empty, every key at the declaring
class's default). At start-up (`registry.build_algorithm`) it is checked against the selected variant's settings
classes: an unknown key, a key of a variant or surrogate not selected, a value of the wrong type or out of its range
exits 2 naming `algo.settings.<key>`. The command line sets a key without `+` (`algo.settings.cispo_eps_high=0.3`;
config/loader.py writes it as `++`, add or replace).

A setting that was a flat `algo.*` key before (`algo.shaping_beta`, `algo.cispo_eps_high`, ...) is a renamed key:
config/aliases.py maps the old name to `algo.settings.<key>` with a notice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exgrpo_megatron.config.domains import Domain
from exgrpo_megatron.config.schema import AlgoConfig

PREFIX = "algo.settings"


@dataclass(frozen=True)
class VariantSettings:
    """The base of a variant's settings dataclass (the fields are its keys, with their defaults)."""

    domains: ClassVar[Mapping[str, Domain]] = {}  # key -> its range (config/domains.py), for the numeric keys

    def config_errors(self) -> list[str]:
        """The relations between its keys (`algo.settings.<key>: reason` lines; none here)."""
        return []


S = TypeVar("S", bound=VariantSettings)


def settings_classes(variant: Any, algo: AlgoConfig) -> tuple[type[VariantSettings], ...]:
    """The settings classes `variant` (an algorithm class) reads: its own `settings_class` and its surrogate's."""
    surrogate = variant.surrogate_class(algo) if hasattr(variant, "surrogate_class") else None
    found = (getattr(variant, "settings_class", None), getattr(surrogate, "settings_class", None))
    return tuple(cls for cls in found if cls is not None)


def setting_keys(classes: tuple[type[VariantSettings], ...]) -> list[str]:
    return sorted(f.name for cls in classes for f in fields(cls))


def read_settings(cls: type[S], algo: AlgoConfig) -> S:
    """`cls` with the keys of it that `algo.settings` sets (types converted as the schema's: an int for a float), the
    others at their defaults. Assumes `settings_errors` found none."""
    own = {f.name for f in fields(cls)}
    values = {key: value for key, value in algo.settings.items() if key in own}
    settings = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    assert isinstance(settings, cls)
    return settings


def settings_errors(algo: AlgoConfig, classes: tuple[type[VariantSettings], ...], owners: Mapping[str, str]
                    ) -> list[str]:
    """`algo.settings.<key>: reason` for every key of `algo.settings` that the selected variant's settings `classes`
    do not define (`owners`: key -> which other variant or surrogate defines it, for the message), whose value has
    the wrong type, or lies out of its range; then each class's relations."""
    known = {f.name: cls for cls in classes for f in fields(cls)}
    errors = []
    for key, value in algo.settings.items():
        if key not in known:
            reads = ", ".join(setting_keys(classes)) or "none"
            where = f"a setting of {owners[key]}" if key in owners else "no variant or surrogate defines it"
            errors.append(f"{PREFIX}.{key}: {value!r} is not read by algo.name={algo.name} ({where}; its settings: "
                          f"{reads})")
            continue
        try:
            OmegaConf.merge(OmegaConf.structured(known[key]), {key: value})
        except OmegaConfBaseException as exc:
            errors.append(f"{PREFIX}.{key}: {value!r}: {str(exc).splitlines()[0]}")
    if errors:
        return errors
    for cls in classes:
        settings = read_settings(cls, algo)
        for key, domain in cls.domains.items():
            reason = domain.problem(getattr(settings, key))
            if reason is not None:
                errors.append(f"{PREFIX}.{key}: {getattr(settings, key)!r}: {reason}")
        errors += [] if errors else settings.config_errors()
    return errors
