"""trainer.update_epochs: N passes over a step's rollouts, each in the same mini-batch updates, all against the
rollout-time pi_old. Two passes must end every step with exactly the weights of a single-pass run whose step is
followed by a second pass that the test runs itself (an independent reference: the trainer's own micro-batches of the
first pass, its phase and normalisers, one more forward/backward + optimizer step each), on the tiny model of
tests/test_trainer.py, observed through the StepObserver hooks."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks
from tests.test_trainer import _overrides

STEPS = 2


def _weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for ch in policy.chunks for p in ch.parameters()]


def _train(overrides: list[str], reference_second_pass: bool) -> dict:
    """run_training observed: per step the update indices, the pi_old the updates saw and the weights at the step's
    end; with `reference_second_pass`, after the trainer's last update of a step the observer repeats that step's
    mini-batch updates once more, in order, on the trainer's own micro-batches (pi_old, phase and normalisers
    unchanged), and also keeps the weights from before that extra pass."""
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.training.step_observer import StepObserver
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    rec: dict = {"updates": {}, "old_logprobs": {}, "weights": {}, "single_pass_weights": {}}

    class Observe(StepObserver):
        def started(self, c) -> None:
            self.c = c

        def step_started(self, step) -> None:
            self.first_pass: list = []
            rec["updates"][step], rec["old_logprobs"][step] = [], []

        def update_started(self, step, update, micro_batches, phase, normalisers) -> None:
            rec["updates"][step].append(update)
            rec["old_logprobs"][step].append([mb.loss_inputs.old_logprobs.clone() for mb in micro_batches])
            self.first_pass.append((micro_batches, phase, normalisers))

        def updated(self, step, update, metrics) -> None:
            c, s = self.c, self.c.settings
            if not reference_second_pass or update != s.updates_per_step - 1:
                return
            rec["single_pass_weights"][step] = _weights(c.policy)
            for micro_batches, phase, normalisers in self.first_pass:
                loss_fn = rl_loss_fn(c.algorithm, phase=phase, normalisers=normalisers,
                                     temperature=s.sampling.temperature, vocab_size=s.vocab_size)
                c.policy.zero_grad()
                c.policy.forward_backward(micro_batches, loss_fn, site="update")
                assert not c.policy.optimizer_step(s.skip_grad_bound).skipped

        def step_finished(self, step, metrics) -> None:
            rec["weights"][step] = _weights(self.c.policy)

    assert run_training(cfg, observers=[Observe()]) == 0
    return rec


@pytest.mark.parametrize("dp", [1, 2])
def test_two_passes_equal_two_consecutive_single_pass_updates_on_the_same_rollouts(tmp_path, dp):
    """trainer.update_epochs=2 (2 mini-batch updates per pass, the rollout's pi_old): update indices 0..3, the second
    pass sees the first pass's pi_old exactly, and every step ends with exactly the weights of the single-pass run +
    the test's own second pass (which moved the weights: the comparison is not vacuous). Fails if the trainer makes
    one pass, recomputes pi_old between passes, or splits the second pass differently. At DP = 2 each rank trains
    its own groups (different rows and token counts per rank) and checks its own weights."""
    common = (f"trainer.total_steps={STEPS}", "algo.name=grpo")
    twos = run_on_ranks(_train, dp, args=(_overrides(str(tmp_path / "two"), extra=(*common, "trainer.update_epochs=2")),
                                          False))
    refs = run_on_ranks(_train, dp, args=(_overrides(str(tmp_path / "ref"), extra=common), True))
    for two, ref, step in ((t, r, s) for t, r in zip(twos, refs, strict=True) for s in range(1, STEPS + 1)):
        assert two["updates"][step] == [0, 1, 2, 3], two["updates"]
        assert ref["updates"][step] == [0, 1], ref["updates"]
        first, second = two["old_logprobs"][step][:2], two["old_logprobs"][step][2:]
        assert sum(len(u) for u in first) > 0
        assert all(torch.equal(a, b) for u1, u2 in zip(first, second, strict=True)
                   for a, b in zip(u1, u2, strict=True)), step
        assert all(torch.equal(a, b) for a, b in zip(two["weights"][step], ref["weights"][step], strict=True)), step
        moved = max(float((a - b).abs().max()) for a, b in zip(ref["weights"][step], ref["single_pass_weights"][step],
                                                               strict=True))
        assert moved > 0.0, step
