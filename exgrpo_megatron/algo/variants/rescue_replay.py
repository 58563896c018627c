"""`algo.name=rescue_replay`: rescue replay (AR3PO, "Adaptive Rollout and Response Reuse", 2025): on-policy GRPO in
which a fresh group whose K responses ALL fail gains ONE stored success of its question (the newest), so the group
has a non-zero advantage; every other group is GRPO's. The stored success trains as in-group replay's replayed rows
(algo/variants/ingroup_replay.py): advantages over the K + 1 rows, the fresh-token loss x min(pi_old / pi_recorded,
C), C its setting `algo.settings.replay_tis_cap` (2 by default; in-group replay's settings), and
`experience.max_age_steps` drops old successes. The response store keeps one success per question (the newest);
nothing is generated for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from exgrpo_megatron.algo.registry import register
from exgrpo_megatron.algo.variants.ingroup_replay import InGroupReplay
from exgrpo_megatron.config.schema import ExperienceConfig
from exgrpo_megatron.experience.response_store import ResponseReplay


@register("rescue_replay")
@dataclass(frozen=True)
class RescueReplay(InGroupReplay):
    experience_keys: ClassVar[frozenset[str]] = frozenset({"max_age_steps", "pool_file_in", "pool_file_out"})
    entropy_reference: ClassVar[bool] = True

    def response_replay(self, experience: ExperienceConfig) -> ResponseReplay | None:
        """One stored success, for a group whose fresh responses all fail."""
        return ResponseReplay(per_question=1, failures=False, rescue_only=True)
