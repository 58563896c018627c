"""ExGRPO as a class outside the package (`algo.name=tests.helpers.counting_algorithm:CountingExGRPO`) that counts
how often a process builds it: a run builds its algorithm once (tests/test_step_observer.py)."""

from __future__ import annotations

from typing import Any

from exgrpo_megatron.algo.variants.exgrpo import ExGRPO

BUILDS: list[str] = []


class CountingExGRPO(ExGRPO):
    @classmethod
    def from_config(cls, name: str, *args: Any, **kwargs: Any) -> Any:
        BUILDS.append(name)
        return super().from_config(name, *args, **kwargs)
