"""The algorithm variants `algo.name` selects (no torch import: config validation reads it).

exgrpo: the experience pool on; grpo: on-policy Dr.GRPO, the same algorithm with experience off (algorithm.py)."""

from __future__ import annotations

ALGORITHMS: dict[str, bool] = {"exgrpo": True, "grpo": False}  # algo.name -> experience on
