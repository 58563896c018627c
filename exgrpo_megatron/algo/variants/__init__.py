"""The built-in algorithm variants, one file each, registered by name (`algo.name`; algo/registry.py imports
every module here on first lookup, `import_all`). A variant's file may register a surrogate of its own too
(algo/surrogates.py)."""

from __future__ import annotations

import importlib
import pkgutil


def import_all() -> None:
    """Import every variant module of this folder (each registers what it defines)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
