"""Fixtures shared across test files."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def sft_cache_dir(tmp_path_factory) -> str:
    """One supervised warm-start cache for the whole run, shared by every test worker (pytest-xdist gives each its
    own base directory under a common one): files that warm-start the same config train it once. Entries are
    keyed by what determines their weights and written under a name of each run's own (policy/warm_start.py)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "sft_cache"
    path.mkdir(exist_ok=True)
    return str(path)
