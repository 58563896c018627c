"""Collectives that cannot finish end the run in bounded time, explained (distributed/collective_watch.py), and the
debug ledger names the first collective the ranks disagree on (distributed/collective_ledger.py).

The planted faults run as real rank processes (tests/collective_worker.py): the run must end by itself with exit
status 5, each rank's stacks or the ledger's report in its own log."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.distributed.collective_ledger import (
    CollectiveLedger,
    LedgerCall,
    RankState,
    blocked_divergence,
)
from exgrpo_megatron.distributed.collective_watch import EXIT_COLLECTIVE_FAILED
from exgrpo_megatron.distributed.launch_env import free_local_port
from tests.helpers.multirank import run_on_ranks
from tests.helpers.rank_processes import log_tail, reap, start_rank_process

EP2_RUN = ["--config-name", "demo_cpu", "model=tiny_qwen3_moe", "model.vocab_size=103", "model.params_dtype=fp32",
           "parallel.expert_model_parallel_size=2", "trainer.sft_warm_start_steps=0", "trainer.total_steps=2",
           "trainer.train_batch_size=4", "trainer.ppo_mini_batch_size=2", "rollout.n=8", "data.max_response_length=16",
           "trainer.val_every=0", "logging.tensorboard=false", "logging.progress_bar=false"]


def _ranks(tmp_path, worker_args: list[str], world: int = 2):
    port = free_local_port()
    return [start_rank_process(["-m", "tests.collective_worker", *worker_args], tmp_path / f"rank{r}.log", rank=r,
                               world=world, port=port) for r in range(world)]


def _session_processes(sid: int) -> list[int]:
    """The processes still alive in session `sid` (a rank process and whatever it started)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


def test_a_planted_hang_ends_within_the_timeout_with_every_ranks_stack(tmp_path):
    """Rank 0 all-reduces over a group the other rank never uses, rank 1 over the default group: before this, both
    waited for gloo's 30 minutes in silence. Now each rank notices after parallel.collective_timeout_s (5 s), names
    its collective, prints its threads' stacks (the planted call in its main thread's) and exits 5."""
    procs = _ranks(tmp_path, ["hang", "5"])
    codes = [reap(p, timeout=150) for p in procs]
    assert codes == [EXIT_COLLECTIVE_FAILED] * 2, log_tail(procs)
    for r, p in enumerate(procs):
        log = p.log_path.read_text()
        header = re.search(rf"rank {r}: collective all_reduce on .* \[0, 1\] has not finished after ([0-9.]+) s "
                           r"\(parallel.collective_timeout_s=5\); stopping the run with exit status 5", log)
        assert header, log[-3000:]
        assert 5 <= float(header.group(1)) < 7
        main_stack = log[log.index("thread MainThread:"):]
        assert "in planted_hang" in main_stack and "dist.all_reduce(x, group=" in main_stack
        assert "the planted hang returned" not in log


def long_progressing_work(rounds: int) -> int:
    """`rounds` all-reduces through the trainer's init path with a 3 s collective timeout; the ranks take turns
    being 0.3 s late, so every collective waits about 0.3 s. The count is fixed, not a rank's own clock (ranks that
    stop on their own clocks may run different numbers of all-reduces: a real hang). Returns the number done."""
    import torch

    from exgrpo_megatron.distributed.runtime import init_distributed

    init_distributed(seed=1, collective_timeout_s=3)
    x = torch.ones(2)
    for n in range(rounds):
        if n % 2 == dist.get_rank():
            time.sleep(0.3)
        dist.all_reduce(x)
    x = torch.tensor([float(rounds)])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


def test_a_long_step_whose_ranks_keep_meeting_is_not_a_hang():
    """About 8 s of collectives under a 3 s timeout: the clock is one collective's wait, not the work's length."""
    counts = run_on_ranks(long_progressing_work, 2, args=(27,), timeout=120)
    assert counts[0] == counts[1] == 27


def test_the_ledger_names_a_planted_rank_only_forward_under_ep(tmp_path):
    """The trainer at EP=2 with the ledger on; in step 1 rank 0 alone runs one more model forward (an EP
    collective). The ranks then block in different collectives; the ledger names the first call that differs on each
    rank (the planted pass's lockstep agreement on rank 0, the pi_old pass's on rank 1) within seconds, far below the
    120 s collective timeout, every rank exits 5, and no process the ranks started (the grader pool) outlives them by
    more than 15 s."""
    args = ["train", "1", "--", *EP2_RUN, f"logging.run_dir={tmp_path / 'run'}", "parallel.collective_ledger=true",
            "parallel.collective_timeout_s=120"]
    start = time.monotonic()
    procs = _ranks(tmp_path, args)
    for p in procs:
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            break
    ended = time.monotonic() - start
    left = {p.pid: _session_processes(p.pid) for p in procs}
    deadline = time.monotonic() + 15
    while any(left.values()) and time.monotonic() < deadline:  # the grader pool ends with its trainer
        time.sleep(0.5)
        left = {p.pid: _session_processes(p.pid) for p in procs}
    codes = [reap(p, timeout=5) for p in procs]
    assert codes == [EXIT_COLLECTIVE_FAILED] * 2, log_tail(procs)
    assert not any(left.values()), left
    assert ended < 110
    for p in procs:
        log = p.log_path.read_text()
        assert "the collective ledger found that ranks [0, 1] wait for each other in different collectives" in log
        differs = log[log.index("the first collective that differs between the ranks"):].splitlines()[1:3]
        # rank 0's extra pass first shows as its lockstep agreement, where rank 1 agrees for its own next pass
        assert re.match(r"  rank 0: call #(\d+) all_reduce on \w+ \[0, 1\] from distributed/lockstep\.py:agree"
                        r"\[planted\] \(pass 'planted'\)", differs[0]), differs
        assert re.match(r"  rank 1: call #\d+ all_reduce on \w+ \[0, 1\] from distributed/lockstep\.py:agree"
                        r"\[old_logprobs\] \(in trainer\.with_old_logprobs\)", differs[1]), differs
        assert "has not finished after" not in log  # the ledger, not the timeout, stopped it


def train_ep2(run_dir: str, ledger: bool) -> tuple[list[dict], int, int]:
    """The run's metrics, and the step and number of collectives of the ledger's last step (0, 0: no ledger)."""
    from exgrpo_megatron.distributed import collective_watch
    from exgrpo_megatron.logging import read_metrics
    from exgrpo_megatron.training.trainer import run_training

    overrides = [*EP2_RUN[2:], f"logging.run_dir={run_dir}", f"parallel.collective_ledger={ledger}"]
    assert run_training(load_config("demo_cpu", overrides)) == 0
    book = collective_watch.active().ledger
    return read_metrics(f"{run_dir}/metrics.jsonl"), book.step if book else 0, len(book.calls) if book else 0


def test_the_ledger_passes_a_normal_ep2_run_and_changes_no_metric(tmp_path):
    """Two trainer steps at EP=2 (each rank its own prompts and responses) with the ledger on end normally, with every
    logged metric but the timings equal to the run without it."""
    off, *no_ledger = run_on_ranks(train_ep2, 2, args=(str(tmp_path / "off"), False))[0]
    on, step, n_calls = run_on_ranks(train_ep2, 2, args=(str(tmp_path / "on"), True))[0]
    assert no_ledger == [0, 0] and step == 2 and n_calls > 100  # the ledger recorded and compared the last step
    assert len(on) == len(off) == 2
    for a, b in zip(on, off, strict=True):
        same = {k for k in a if not k.startswith(("time/", "throughput/"))}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


def _call(number: int, op: str, group: str, site: str = "policy/policy.py:forward_backward") -> LedgerCall:
    return LedgerCall(number, op, group, {"1": "EXPERT_MODEL_PARALLEL_GROUP", "0": "default_pg"}[group], (0, 1), site,
                      "")


def test_the_step_boundary_comparison_names_the_first_different_call():
    """Two ranks' ledgers of one step, compared through a store as at a step's end: equal ones pass; when rank 1
    issued an all_gather where rank 0 issued an all_reduce on the same group, both ranks name those calls."""
    def compare(calls: dict[int, list[LedgerCall]], step: int) -> dict[int, list[str] | None]:
        store, out = dist.HashStore(), {}
        store.set_timeout(timedelta(seconds=30))

        def rank(r: int) -> None:
            ledger = CollectiveLedger(r, 2)
            ledger.begin_step(step)
            ledger.calls = calls[r]
            out[r] = ledger.check_step(store, step)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return out

    same = [_call(1, "all_reduce", "0"), _call(2, "all_to_all_single", "1")]
    assert compare({0: same, 1: list(same)}, 3) == {0: None, 1: None}
    other = [same[0], _call(2, "all_gather", "1", "experience/routing.py:all_gather_choices")]
    found = compare({0: same, 1: other}, 4)
    for r in (0, 1):
        assert found[r][0] == f"rank {r}: the collective ledger found ranks issuing different collectives in step 4"
        assert found[r][2:] == [
            "  rank 0: call #2 all_to_all_single on EXPERT_MODEL_PARALLEL_GROUP [0, 1] from "
            "policy/policy.py:forward_backward",
            "  rank 1: call #2 all_gather on EXPERT_MODEL_PARALLEL_GROUP [0, 1] from "
            "experience/routing.py:all_gather_choices"]


@pytest.mark.parametrize("rank1, hang", [
    (None, False),  # rank 1 has not published: it is computing, not blocked
    (RankState(2, 1, [_call(1, "all_reduce", "0"), _call(2, "all_to_all_single", "1")]), False),  # the same call
    (RankState(2, 1, [_call(1, "all_reduce", "0"), _call(2, "all_reduce", "0")]), True),  # another group: a cycle
    (RankState(2, -1, [_call(1, "all_reduce", "0")]), True),  # at the step's end while rank 0 waits for it
])
def test_only_ranks_that_wait_for_each_other_are_a_divergence(rank1, hang):
    """Rank 0 is blocked in an EP all-to-all; a slow peer or one in the same call is not a divergence, a peer blocked
    in a call rank 0 never issues (or at the step's end) is."""
    rank0 = RankState(2, 1, [_call(1, "all_reduce", "0"), _call(2, "all_to_all_single", "1")])
    states = {0: rank0} if rank1 is None else {0: rank0, 1: rank1}
    found = blocked_divergence(states)
    assert (found is not None) == hang
    if hang:
        assert "ranks [0, 1] wait for each other in different collectives in step 2" in found[0]
        assert found[2] == ("  rank 0: call #2 all_to_all_single on EXPERT_MODEL_PARALLEL_GROUP [0, 1] from "
                            "policy/policy.py:forward_backward")
