"""The built-in algorithm variants, one file each, registered by name (`algo.name`; algo/registry.py imports
every module here on first lookup)."""
