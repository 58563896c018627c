"""Fixtures shared across test files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.preset_inputs import preset_inputs


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


@pytest.fixture
def preset_paths(tmp_path: Path, monkeypatch) -> list[str]:
    """tests/helpers/preset_inputs.py for in-process runs of a GPU preset: the env is set, the data overrides are
    returned."""
    env, overrides = preset_inputs(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return overrides
