"""Routing replay (R3, "rollout routing replay"): the experts each token was routed to when it was generated, recorded
by the rollout engine and imposed on the training forwards (`model.moe_routing_replay`).

Why: an MoE policy's log-prob of a token depends on which top-k experts its router picks. The engine and the trainer
run the same weights but not bit-identical arithmetic (other kernels, batch shapes, bf16), so near-tied router logits
pick different experts and pi_theta / pi_old measures routing noise as well as the policy change; MoE GRPO runs
collapse from it (Megatron-LM issue 4168). Replaying the rollout's choices makes the trainer score the trajectory with
the experts that generated it; the router's weights still learn through the replayed experts' probabilities.

Mechanism: megatron-core's `TopKRouter` asks its `router_replay` object for the top-k (`get_replay_topk`, the hook its
own `RouterReplay` uses). `RouterChoices`, attached to every router of the policy, computes the router's own top-k and
* records the experts it routes to (`recording`; the engine while generating): per forward, [tokens, k] expert ids in
  megatron's [s, b] order;
* with a per-token target ([tokens, k], -1 = none), counts the tokens whose expert set differs from the target
  (`counting`) and, when replaying, routes every token that has a target to the target's experts, the others (a
  replayed pool trajectory, padding, a sequence's last token, which generation never fed) by the router itself.
Probabilities are the router's scores gathered at the chosen experts, as megatron-core's own top-k computes them.

What a trajectory replayed from the experience pool uses: the current router. Its choices were recorded under an old
policy and the pool keeps token ids and log-probs only; its pi_old (the selection pass) and pi_theta (the update)
then both come from the current router, and its importance weight against the recorded behaviour log-probs carries
the difference, as for a dense model. The K-1 fresh rollouts beside it replay their own recorded choices.

Metrics (training updates, real tokens with a recorded choice): `moe/routing_disagreement`, the fraction of (token,
layer) pairs whose top-k set under the training forward differs from the rollout's (measured whether or not the run
replays); `moe/routing_replayed_share`, the share of routed token-layer pairs that had a recorded choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RouterChoices:
    """One router's hook (megatron-core's `router_replay` interface): records, compares and replays its top-k."""

    def __init__(self) -> None:
        self.recording = False
        self.recorded: torch.Tensor | None = None  # [tokens, k] of the last forward while recording
        self.target: torch.Tensor | None = None  # [tokens, k] int64, -1 rows: the router decides
        self.replay = False
        self.counting = False
        self.compared = 0  # (token) rows with a target, while counting
        self.differing = 0  # of them, rows whose expert set differs from the target
        self.routed = 0  # rows routed while counting

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopK | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        count, self.counting = self.counting, False  # once per forward (an activation recompute runs it again)
        if count:
            self.routed += chosen.shape[0]
        if self.target is not None:
            target = self.target.to(chosen.device)
            has = target[:, 0] >= 0
            if count:
                self.compared += int(has.sum())
                self.differing += int(differing_sets(chosen[has], target[has]).sum())
            if self.replay:
                chosen = torch.where(has[:, None], target, chosen)
                probs = scores.gather(1, chosen)
        if self.recording:
            self.recorded = chosen.detach().to("cpu")
        return probs, chosen


def differing_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row of two [n, k] expert-id tensors: True where the two sets of k experts differ (order ignored)."""
    return (a.sort(dim=1).values != b.sort(dim=1).values).any(dim=1)


def router_choices(model: Any) -> list[RouterChoices]:
    """The `RouterChoices` of `model`'s routers, in layer order ([] for a dense model or one without them)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.router_replay for m in model.modules()
            if isinstance(m, TopKRouter) and isinstance(m.router_replay, RouterChoices)]


def attach(modules: Sequence[torch.nn.Module]) -> list[RouterChoices]:
    """A `RouterChoices` on every router of the model chunks, in layer order (chunk by chunk)."""
    from megatron.core.transformer.moe.router import TopKRouter

    hooks = []
    for chunk in modules:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                if m.config.moe_router_fusion:
                    raise ValueError("model.moe_routing_replay: the fused router (moe_router_fusion) skips the "
                                     "router_replay hook; it cannot be recorded or replayed")
                m.router_replay = RouterChoices()
                hooks.append(m.router_replay)
    return hooks


@contextmanager
def recording(hooks: list[RouterChoices]) -> Iterator[Callable[[int, int], np.ndarray | None]]:
    """While inside, every router records its top-k; yields `take(seq, batch)`: the last forward's choices as
    [seq, batch, layers, k] int16 (megatron's [s, b] token order), or None for a dense model."""
    for h in hooks:
        h.recording, h.recorded = True, None

    def take(seq: int, batch: int) -> np.ndarray | None:
        if not hooks:
            return None
        layers = []
        for h in hooks:
            assert h.recorded is not None, "a router did not run in the last forward"
            layers.append(h.recorded.reshape(seq, batch, -1))
            h.recorded = None
        return torch.stack(layers, dim=2).to(torch.int16).numpy()

    try:
        yield take
    finally:
        for h in hooks:
            h.recording, h.recorded = False, None


def micro_batch_targets(tokens_shape: tuple[int, ...], starts: Sequence[tuple[int, int]],
                        choices: Sequence[np.ndarray | None], layers: int, topk: int) -> torch.Tensor | None:
    """Per-layer targets [layers, s * b, k] (-1 where none) of a micro-batch of `tokens_shape` [b, s] whose j-th
    sequence starts at `starts[j]` (row, column) and whose recorded choices are `choices[j]` ([T_j, layers, k], the
    first T_j tokens of the sequence, or None); flattened in megatron's [s, b] order (index = column * b + row)."""
    if all(c is None for c in choices):
        return None
    b, s = tokens_shape
    target = torch.full((layers, s, b, topk), -1, dtype=torch.int64)
    for (row, col), c in zip(starts, choices, strict=True):
        if c is None:
            continue
        if c.shape[1:] != (layers, topk):
            raise ValueError(f"recorded expert choices of shape {c.shape[1:]}, the model has {layers} MoE layers "
                             f"x top-{topk} here")
        target[:, col: col + c.shape[0], row] = torch.from_numpy(c.astype(np.int64)).permute(1, 0, 2)
    return target.reshape(layers, s * b, topk)


class RoutingReplay:
    """The policy's routers' hooks: recorded choices imposed per micro-batch (`set_targets`), disagreement counted."""

    def __init__(self, modules: Sequence[torch.nn.Module], replay: bool) -> None:
        self.hooks = attach(modules)
        self.replay = replay
        config: Any = modules[0].config if self.hooks else None
        self.topk: int = config.moe_router_topk if config is not None else 0
        self.device = next(modules[0].parameters()).device  # the targets move there once per micro-batch

    def set_targets(self, tokens_shape: tuple[int, ...], starts: Sequence[tuple[int, int]],
                    choices: Sequence[np.ndarray | None] | None, count: bool) -> None:
        """The next forward's micro-batch: its rows' recorded choices become the routers' targets (replayed with
        `model.moe_routing_replay`, compared always; the disagreement counted once when `count`). They stay until
        the next call or the end of the pass (`pass_scope`), so full activation recompute, which re-runs this
        micro-batch's routers in its backward before the next micro-batch's forward (one pipeline stage), routes as
        the forward did."""
        target = None
        if self.hooks and choices is not None:
            target = micro_batch_targets(tokens_shape, starts, choices, len(self.hooks), self.topk)
            target = None if target is None else target.to(self.device)
        for i, h in enumerate(self.hooks):
            h.target = None if target is None else target[i]
            h.replay, h.counting = self.replay, count

    @contextmanager
    def pass_scope(self) -> Iterator[None]:
        """One pass of the policy (its micro-batches' forwards and backwards): no target outlives it."""
        try:
            yield
        finally:
            for h in self.hooks:
                h.target, h.counting = None, False

    def take_metrics(self, dp_group: Any) -> dict[str, float]:
        """The step's routing metrics summed over `dp_group` (collective); {} for a dense model."""
        if not self.hooks:
            return {}
        sums = torch.tensor([[h.compared, h.differing, h.routed] for h in self.hooks], dtype=torch.float64).sum(0)
        for h in self.hooks:
            h.compared = h.differing = h.routed = 0
        dist.all_reduce(sums, group=dp_group)
        compared, differing, routed = (float(x) for x in sums)
        return {"moe/routing_disagreement": differing / compared if compared else 0.0,
                "moe/routing_replayed_share": compared / routed if routed else 0.0}
