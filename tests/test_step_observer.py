"""A step observer (`run_training(cfg, observers=[...])`) receives what each verb of every step produced, in order,
and what it receives is what the run logged: a tiny demo run (from scratch, DP=1) recorded by an observer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.training.step_observer import StepObserver
from tests.helpers.multirank import run_on_ranks
from tests.test_trainer import _overrides

STEPS, BATCH, K, MINI = 2, 4, 4, 2


class Recorder(StepObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.steps: dict[int, dict] = {}

    def _at(self, step: int, hook: str) -> dict:
        self.calls.append((step, hook))
        return self.steps.setdefault(step, {"passes": [], "losses": [], "updates": []})

    def started(self, c) -> None:
        self.calls.append((0, "started"))
        self.algorithm = c.algorithm.name

    def step_started(self, step) -> None:
        from exgrpo_megatron.checkpoint import model_state

        manager = getattr(model_state._RESULTS_MANAGER, "_process", None)
        self._at(step, "step_started")["results_manager_up"] = manager is not None and manager.is_alive()

    def planned(self, step, groups) -> None:
        self._at(step, "planned")["planned"] = len(groups)

    def generated(self, step, groups, samples) -> None:
        self._at(step, "generated")["generated"] = [len(s) for s in samples]

    def rolled_out(self, step, rollouts) -> None:
        self._at(step, "rolled_out")["groups"] = len(rollouts.groups)

    def rows_built(self, step, rows) -> None:
        rec = self._at(step, "rows_built")
        rec["reward_mean"] = sum(rows.rewards) / len(rows.rewards)

    def batch_ready(self, step, batch) -> None:
        self._at(step, "batch_ready")["old_rows"] = None if batch.old_logprobs is None else len(batch.old_logprobs)

    def update_started(self, step, update, micro_batches, phase, normalisers) -> None:
        self._at(step, "update_started")["updates"].append(
            {"rows": sum(len(mb.rows) for mb in micro_batches), "phase": phase.value, "pg_norm": normalisers[0]})

    def loss_computed(self, step, update, output, micro_batch, loss, metrics) -> None:
        self._at(step, "loss_computed")["losses"].append((update, float(metrics["pg_loss"])))

    def updated(self, step, update, metrics) -> None:
        self._at(step, "updated")["updates"][update]["loss_metrics"] = len(metrics.loss_metrics)

    def policy_pass(self, step, site, micro_batches, forward_only) -> None:
        self._at(step, "policy_pass")["passes"].append(forward_only)

    def step_finished(self, step, metrics) -> None:
        self._at(step, "step_finished")["metrics"] = dict(metrics)


def _train_observed(overrides: list[str]) -> dict:
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    rec = Recorder()
    assert run_training(cfg, observers=[rec]) == 0
    logged = [json.loads(line) for line in (Path(cfg.logging.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"calls": rec.calls, "steps": rec.steps, "algorithm": rec.algorithm, "logged": logged}


def test_an_observer_receives_every_verbs_result_as_logged(tmp_path):
    got = run_on_ranks(_train_observed, 1, args=(_overrides(str(tmp_path / "obs"), extra=(
        f"trainer.total_steps={STEPS}", "algo.old_logprobs=recompute")),))[0]
    assert got["algorithm"] == "exgrpo" and got["calls"][0] == (0, "started")
    # up before step 1 (started during start-up), so a preemption save never waits on a Manager still starting
    assert got["steps"][1]["results_manager_up"]
    order = ["step_started", "planned", "generated", "rolled_out", "rows_built", "batch_ready", "update_started",
             "updated", "step_finished"]
    for step in range(1, STEPS + 1):
        hooks = [h for s, h in got["calls"] if s == step and h not in ("policy_pass", "loss_computed")]
        assert [h for h in order if h in hooks] == order and hooks.index("step_started") == 0, hooks
        assert hooks[-1] == "step_finished"
        rec, logged = got["steps"][step], got["logged"][step - 1]
        assert rec["planned"] == BATCH and rec["generated"] == [K] * BATCH and rec["groups"] == BATCH
        assert rec["reward_mean"] == pytest.approx(logged["reward/mean"], rel=1e-12)
        assert rec["old_rows"] == BATCH * K  # pi_old recomputed for every row
        assert [u["rows"] for u in rec["updates"]] == [MINI * K] * (BATCH // MINI)
        assert all(u["loss_metrics"] >= 1 for u in rec["updates"])
        assert sum(pg for _, pg in rec["losses"]) == pytest.approx(logged["loss/policy"], rel=1e-12)
        # one forward-only pass for pi_old (plus the selection pass when replaying), one pass per update
        assert rec["passes"].count(False) == BATCH // MINI and rec["passes"][0] is True
        assert rec["metrics"]["loss/policy"] == logged["loss/policy"]


def test_observers_are_called_in_order_with_the_step_and_a_name_that_is_no_hook_is_refused():
    """`StepObservers.notify` reaches every observer's hook in order, the hooks of a step led by the current step, and
    refuses a misspelt hook even with no observer (a silently ignored name would drop what a test watches)."""
    from exgrpo_megatron.training.step_observer import HOOKS, STEP_HOOKS, StepObservers

    assert STEP_HOOKS == set(HOOKS) - {"distributed", "started"}
    seen: list[tuple[str, str, tuple]] = []

    class Log(StepObserver):
        def __init__(self, name: str) -> None:
            self.name = name

    for hook in HOOKS:
        setattr(Log, hook, lambda self, *args, _hook=hook: seen.append((self.name, _hook, args)))
    observers = StepObservers([Log("a"), Log("b")])
    observers.notify("distributed", "layout")
    observers.begin(7)
    observers.notify("planned", ["g"])
    assert seen == [("a", "distributed", ("layout",)), ("b", "distributed", ("layout",)),
                    ("a", "step_started", (7,)), ("b", "step_started", (7,)),
                    ("a", "planned", (7, ["g"])), ("b", "planned", (7, ["g"]))]
    with pytest.raises(ValueError, match="'plannned' is not a StepObserver hook"):
        StepObservers().notify("plannned", [])


def _builds_in_a_run(overrides: list[str]) -> tuple[int, int, str]:
    from exgrpo_megatron import train
    from tests.helpers import counting_algorithm

    class Name(StepObserver):
        def started(self, c) -> None:
            self.algorithm = type(c.algorithm).__name__

    seen = Name()
    code = train.main(["--config-name", "demo_cpu", *overrides], observers=[seen])
    return code, len(counting_algorithm.BUILDS), seen.algorithm


def test_a_run_builds_its_algorithm_once(tmp_path):
    """The training CLI validates the config by building the algorithm and trains with that same object: one build
    per run (the start-up block, the components and the loss all read it)."""
    name = "algo.name=tests.helpers.counting_algorithm:CountingExGRPO"
    code, builds, used = run_on_ranks(_builds_in_a_run, 1, args=(
        _overrides(str(tmp_path / "once"), extra=("trainer.total_steps=1", name)),))[0]
    assert (code, builds, used) == (0, 1, "CountingExGRPO")
