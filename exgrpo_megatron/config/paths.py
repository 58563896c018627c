"""Paths the run writes into or verifies, checked at start-up without creating anything (config/domains.py
reports them with exit 2; distributed/run_lock.py checks again before taking the run directory's lock).

A weights directory the run reads is *sealed* when it carries a manifest of its files' sizes and sha256s:
`checkpoint.json` (a trainer checkpoint) or `manifest.json` (a weights-only dir: converters, the SFT cache).
"""

from __future__ import annotations

import os
from pathlib import Path

TRAINER_MANIFEST = "checkpoint.json"  # written last inside a trainer checkpoint (checkpoint/layout.py)
WEIGHTS_MANIFEST = "manifest.json"  # written last inside a weights-only dir (checkpoint/integrity.py)


def is_sealed(path: str | Path) -> bool:
    """A weights dir the run can verify: a trainer checkpoint or a sealed weights-only dir."""
    path = Path(path).expanduser()
    return (path / TRAINER_MANIFEST).is_file() or (path / WEIGHTS_MANIFEST).is_file()


def run_dir_problem(run_dir: str | Path) -> str | None:
    """Why `run_dir` cannot hold a run, as a `logging.run_dir: ...` line, or None. Creates nothing."""
    path = Path(run_dir).expanduser()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "" if probe == path else f" (its ancestor {probe} is not)"
        return f"logging.run_dir: {str(run_dir)!r}: not a directory{what}"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"logging.run_dir: {str(run_dir)!r}: {probe} is not writable"
    latest = path / "checkpoints" / "latest"
    if latest.is_dir() and not latest.is_symlink():
        return (f"logging.run_dir: {str(run_dir)!r}: {latest} is a directory; it must be the pointer file the "
                "trainer writes (move the directory away)")
    return None
