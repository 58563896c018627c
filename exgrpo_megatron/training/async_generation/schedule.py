"""Generating ahead of training (`rollout.max_staleness` = s > 0), the trainer's side.

The schedule is fixed, so a run is reproducible: at the start of step t the trainer takes step t's rollouts,
adds them to the pool, composes step t+s's plan (the pool, the phase and the replay scorer as they are now) and
sends it to the generator with its current weights -- those after step t-1 -- then trains step t while the
generator generates. Step t therefore trains on rollouts of the weights after step t-s-1, s updates older than
pi_old (fewer in the first s steps, which all use the initial weights); the trainer waits only for what it has
not received yet. Which weights score a plan's replay candidates: the trainer's when the plan is composed (after
step t-1), the ones its fresh rollouts come from.

In flight at a checkpoint: the plans of steps t+1..t+s and their rollouts. Saving waits for those rollouts and
stores them with the plans in the checkpoint's trainer state, so a resumed run trains on exactly the rollouts an
uninterrupted one would (they are never regenerated: the weights they came from are not in the checkpoint).

Only the trainer's global rank 0 talks to the generator (link.py); it broadcasts each step's rollouts to
every rank, and each DP rank trains on its share. The weights are gathered to full tensors by the ranks of DP
replica 0 (rollout/refit.py), in the dtype they train in; with LoRA each adapted linear's weight is sent merged,
W + B A alpha / r (the vLLM refit's merge), so the generator's model has no adapters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from exgrpo_megatron.config.schema import RootConfig
from exgrpo_megatron.config.validate import ConfigError
from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.distributed.launch_env import free_local_port
from exgrpo_megatron.distributed.lifetime import parent_token
from exgrpo_megatron.distributed.preemption import PreemptionHandler
from exgrpo_megatron.experience.types import Trajectory
from exgrpo_megatron.rollout.refit import iter_merged_param_buckets
from exgrpo_megatron.rollout.types import Sample
from exgrpo_megatron.training.async_generation.generator import RolloutRequest, RolloutResult, WeightBucket, serve
from exgrpo_megatron.training.async_generation.link import TRAINER, Link
from exgrpo_megatron.training.async_generation.watch import (
    EXIT_GENERATOR_FAILED,
    Deadline,
    GeneratorFailed,
    PreemptedWhileWaiting,
    exit_text,
    process_state,
)

WEIGHT_BUCKET_BYTES = 256 << 20
WATCH_SECONDS = 1.0  # how often the waiting trainer looks at the generator (alive? late?)


@dataclass
class Planned:
    """A step whose rollouts were asked for: its plan (identical on every rank)."""

    phase: str  # the schedule's phase when it was composed (its loss's phase)
    groups: list[QuestionGroup]


def generator_device(spec: str) -> int | None:
    """rollout.generator.device -> the CUDA index (None: CPU); auto = CPU, or on GPU the first device after this
    node's trainer ranks (torchrun's LOCAL_WORLD_SIZE)."""
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return None
    index = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if spec == "auto" else int(spec.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError([f"rollout.generator.device: {spec!r} is cuda:{index}, but this node has "
                           f"{torch.cuda.device_count()} GPUs (start fewer trainer ranks per node, or name a device)"])
    return index


class AheadGeneration:
    def __init__(self, cfg: RootConfig, rank: int, gathers_weights: bool, modules: list[torch.nn.Module]) -> None:
        self.staleness = cfg.rollout.max_staleness
        self.main = rank == 0
        self.gathers_weights = gathers_weights  # a rank of DP replica 0 (CP rank 0)
        self.modules = modules
        self.generator_weights_step: int | None = None  # what the generator holds (the same on every rank)
        self.planned: dict[int, Planned] = {}  # asked for, not yet taken (the same on every rank)
        self.restored: dict[int, RolloutResult] = {}  # rank 0: in-flight rollouts read from a checkpoint
        self.lost: set[int] = set()  # planned steps whose rollouts a failed generator took with it (resumed runs)
        self.results: dict[int, RolloutResult] = {}  # rank 0: answers received
        self.error: BaseException | None = None  # rank 0: the link thread's failure
        self.failure: str | None = None  # the generator failed (the same on every rank once a take() saw it)
        self.ready = threading.Condition()
        self.requests: queue.Queue = queue.Queue()
        g = cfg.rollout.generator
        self.deadline = Deadline(g.deadline_factor, g.deadline_min_seconds, g.startup_timeout_seconds)
        self.busy_since: float | None = time.monotonic()  # rank 0: when the round in progress began (None: idle)
        self.preemption: PreemptionHandler | None = None  # rank 0 watches its flag while it waits (watch_preemption)
        self.gave_up_for_preemption = False  # rank 0: the failure is a generator not waited for after a signal
        if self.main:
            port = free_local_port()
            self.process = mp.get_context("spawn").Process(
                target=serve, args=(cfg, "127.0.0.1", port, generator_device(g.device), parent_token()),
                name="exgrpo-generator")
            self.process.start()
            print(f"exgrpo-train: generator process started (pid {self.process.pid})", file=sys.stderr, flush=True)
            # the link is made, and "ready" awaited, on the link's thread: the main thread never blocks on the
            # generator outside _wait_for, which watches the deadline and stays responsive to signals
            self.thread = threading.Thread(target=self._serve_requests, args=(port,), name="exgrpo-generator-link",
                                           daemon=True)
            self.thread.start()

    def watch_preemption(self, handler: PreemptionHandler) -> None:
        """While waiting for the generator, act on a preemption signal this rank receives (watch.py)."""
        self.preemption = handler

    # ---------------------------------------------------------------- the schedule
    def steps_to_plan(self, step: int) -> list[int]:
        """Steps step..step+s-1 with no plan yet (at the start of a run: all of them; after a resume: none)."""
        return [t for t in range(step, step + self.staleness) if t not in self.planned]

    def submit(self, step: int, phase: str, groups: list[QuestionGroup], weights_step: int) -> None:
        """Ask for step `step`'s rollouts from the weights after `weights_step` steps (the current ones). Collective
        over DP replica 0 when the generator does not hold those weights yet."""
        flats: list[torch.Tensor] = []
        buckets: list[WeightBucket] | None = None
        if weights_step != self.generator_weights_step:
            if self.gathers_weights:
                buckets = []
                for bucket in iter_merged_param_buckets(self.modules, WEIGHT_BUCKET_BYTES):
                    if not bucket:  # a weight waiting for its adapters, merged into the next bucket
                        continue
                    buckets.append(([(name, tuple(t.shape)) for name, t in bucket], bucket[0][1].dtype))
                    flats.append(torch.cat([t.detach().reshape(-1).cpu() for _, t in bucket]))  # a snapshot
            self.generator_weights_step = weights_step
        self.planned[step] = Planned(phase, groups)
        if self.main:
            self.requests.put((RolloutRequest(step, groups, weights_step, buckets), flats))

    def take(self, step: int) -> tuple[Planned, RolloutResult]:
        """Step `step`'s plan and rollouts on every rank (rank 0 waits for them, then broadcasts). GeneratorFailed on
        every rank when the generator died or missed its deadline (watch.py): the step stays planned."""
        for t in sorted(self.lost):  # a resumed run whose generator had failed: ask again, from the current weights
            self.lost.discard(t)
            self.submit(t, self.planned[t].phase, self.planned[t].groups, weights_step=step - 1)
        payload: list[Any] = [None]
        if self.main:
            try:
                payload[0] = self._wait_for(step)
            except GeneratorFailed as exc:
                payload[0] = str(exc)
            except PreemptedWhileWaiting as exc:
                payload[0] = ("preempted", str(exc))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], tuple):
            self.failure = payload[0][1]
            raise PreemptedWhileWaiting(payload[0][1])
        if isinstance(payload[0], str):
            self.failure = payload[0]
            raise GeneratorFailed(payload[0])
        return self.planned.pop(step), payload[0]

    def _wait_for(self, step: int) -> RolloutResult:
        """Rank 0: step `step`'s rollouts once they are here (an answer received before a failure still counts);
        GeneratorFailed when the generator died, broke the link or missed its deadline first."""
        if step in self.restored:
            return self.restored.pop(step)
        with self.ready:
            while step not in self.results:
                if self.failure is not None:  # also when a save gave up on it for a preemption signal (below)
                    raise (PreemptedWhileWaiting if self.gave_up_for_preemption else GeneratorFailed)(self.failure)
                if self.error is not None:
                    self._check_generator(step, self.error)
                if not self.ready.wait_for(lambda: step in self.results or self.error is not None, WATCH_SECONDS):
                    self._check_generator(step)
                    self._stop_waiting_if_preempted(step)
            return self.results.pop(step)

    def _stop_waiting_if_preempted(self, step: int) -> None:
        """Rank 0 received a preemption signal and the generator is stopped or late: kill it, raise
        PreemptedWhileWaiting (watch.py)."""
        if self.preemption is None or not self.preemption.received:
            return
        late = None if self.busy_since is None else time.monotonic() - self.busy_since
        pid = int(self.process.pid or 0)
        state = process_state(pid)
        if not state.startswith("stopped"):
            if late is None or self.deadline.usual(late):
                return  # within its usual round time: its answer keeps the requeued run bitwise equal
            state = (f"has not answered for {late:.0f} s (the slowest round so far took "
                     f"{self.deadline.slowest_round:.1f} s)" if self.deadline.rounds else
                     f"has not answered its first round yet ({late:.0f} s since it started)")
        else:
            state = f"is {state}"
        self.failure = (f"step {step}'s rollouts were awaited, and the generator process (pid {pid}) {state}: not "
                        "waiting for it (it is killed; the rollouts not received are asked for again after the "
                        "requeue)")
        self.gave_up_for_preemption = True
        self.process.kill()
        raise PreemptedWhileWaiting(self.failure)

    def _check_generator(self, step: int, error: BaseException | None = None) -> None:
        """Raise GeneratorFailed (and kill the generator) when it died, missed its deadline or broke the link."""
        late = None if self.busy_since is None else time.monotonic() - self.busy_since
        pid = int(self.process.pid or 0)
        if error is not None:
            self.process.join(timeout=5)  # a peer that died closed the link a moment before its exit is seen
        if not self.process.is_alive():
            why = f"died ({exit_text(self.process.exitcode)})"
        elif error is not None:
            why = f"broke the link ({type(error).__name__}: {error})"
        elif late is not None and late > self.deadline.seconds():
            state = process_state(pid)
            why = (f"has not answered for {late:.0f} s{f', and is {state}' if state else ''}; the deadline is "
                   f"{self.deadline.seconds():.0f} s = {self.deadline.explain()}")
        else:
            return
        self.failure = (f"the generator process (pid {pid}) {why}, while step {step}'s rollouts were awaited; it is "
                        f"killed, the last whole step is saved and the run exits {EXIT_GENERATOR_FAILED} "
                        "(a relaunch resumes and asks again for the rollouts in flight)")
        self.process.kill()
        raise GeneratorFailed(self.failure) from error

    def _serve_requests(self, port: int) -> None:
        try:
            self.link = Link("127.0.0.1", port, TRAINER)
            self.link.recv_object()  # "ready": the generator built its model, engine and grader
            while (item := self.requests.get()) is not None:
                request, flats = item
                with self.ready:
                    started = time.monotonic()
                    if self.deadline.rounds:  # the first round runs on the start-up allowance, from the process start
                        self.busy_since = started
                self.link.send_object(request)
                for flat in flats:
                    self.link.send_tensor(flat)
                result = self.link.recv_object()
                with self.ready:
                    self.deadline.observe(time.monotonic() - started)
                    self.busy_since = None
                    self.results[result.step] = result
                    self.ready.notify_all()
            self.link.send_object(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
            with self.ready:
                self.error = exc
                self.ready.notify_all()

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The plans in flight and (rank 0, waiting for them) their rollouts, JSON-able. After the generator failed,
        a plan whose rollouts never arrived is saved with "result": null; a resumed run asks for them again."""
        steps = sorted(self.planned)
        results = {t: self._wait_for_keep(t) for t in steps} if self.main else {}
        return {"in_flight": [{"step": t, "phase": self.planned[t].phase,
                               "groups": [_group_json(g) for g in self.planned[t].groups],
                               "result": None if (r := results.get(t)) is None else _result_json(r)} for t in steps]}

    def _wait_for_keep(self, step: int) -> RolloutResult | None:
        try:
            result = self._wait_for(step)
        except (GeneratorFailed, PreemptedWhileWaiting):
            return None  # saved without it; the next take() reports the failure on every rank
        self.restored[step] = result  # still to be taken
        return result

    def load_state_dict(self, state: dict) -> None:
        for entry in state.get("in_flight", []):
            step = int(entry["step"])
            self.planned[step] = Planned(entry["phase"], [_group_from_json(g) for g in entry["groups"]])
            if entry["result"] is None:
                self.lost.add(step)
            elif self.main:
                self.restored[step] = _result_from_json(entry["result"])

    def close(self) -> None:
        if not self.main:
            return
        if self.failure is not None or not self.process.is_alive():
            self.process.kill()  # stopped or hung: nothing to wait for (the link's thread then ends too)
        self.requests.put(None)
        self.thread.join(timeout=60)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


# -------------------------------------------------------------------- JSON (floats round-trip exactly)
def _group_json(g: QuestionGroup) -> dict:
    replay = None if g.replay is None else {"token_ids": g.replay.token_ids.tolist(),
                                            "logprobs": g.replay.logprobs.tolist(), "step": g.replay.step}
    current = None if g.replay_current_logprobs is None else np.asarray(g.replay_current_logprobs).tolist()
    return {"qid": g.qid, "prompt_ids": list(g.prompt_ids), "answer": g.answer, "replay": replay,
            "bucket": g.bucket, "replay_current_logprobs": current}


def _group_from_json(d: dict) -> QuestionGroup:
    r = d["replay"]
    replay = None if r is None else Trajectory(np.asarray(r["token_ids"], dtype=np.int32),
                                               np.asarray(r["logprobs"], dtype=np.float32), int(r["step"]))
    current = d["replay_current_logprobs"]
    return QuestionGroup(int(d["qid"]), list(d["prompt_ids"]), d["answer"], replay, d["bucket"],
                         None if current is None else np.asarray(current, dtype=np.float32))


def _result_json(r: RolloutResult) -> dict:
    return {"step": r.step, "weights_step": r.weights_step, "rewards": r.rewards,
            "samples": [[{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "logprobs": s.logprobs,
                          "finish_reason": s.finish_reason, "is_replay": s.is_replay} for s in g] for g in r.samples],
            "generate_seconds": r.generate_seconds, "load_seconds": r.load_seconds,
            "grader_timeouts": r.grader_timeouts, "grader_worker_deaths": r.grader_worker_deaths}


def _result_from_json(d: dict) -> RolloutResult:
    samples = [[Sample(list(s["prompt_ids"]), list(s["response_ids"]), [float(x) for x in s["logprobs"]],
                       s["finish_reason"], bool(s["is_replay"])) for s in g] for g in d["samples"]]
    return RolloutResult(int(d["step"]), samples, [[float(x) for x in g] for g in d["rewards"]],
                         int(d["weights_step"]), float(d["generate_seconds"]), float(d["load_seconds"]),
                         int(d["grader_timeouts"]), int(d["grader_worker_deaths"]))
