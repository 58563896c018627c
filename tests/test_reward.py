"""Math-Verify scoring (reference §4.3) and the killable GraderPool, with real Math-Verify and real processes."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pytest

from exgrpo_megatron.reward.grader import GraderPool, score_response, validate_timeout
from exgrpo_megatron.reward.grader_worker import take_chunk
from exgrpo_megatron.reward.scoring import extract_answer

# (response text as generated after a prompt ending in "<think>\n", gold, require_think, expected reward)
GRADING_TABLE: list[tuple[str, str, bool, float]] = [
    ("2+2 is 4.</think>\nThe answer is \\boxed{4}.", "4", True, 1.0),
    ("work</think> \\boxed{5}", "4", True, 0.0),  # wrong integer
    ("halve it</think> \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, 1.0),
    ("</think> \\boxed{0.5}", "\\frac{1}{2}", True, 1.0),  # decimal vs LaTeX fraction gold
    ("</think> \\boxed{\\dfrac12}", "0.5", True, 1.0),  # \dfrac shorthand vs decimal gold
    ("</think> so the answer is 1/2", "\\frac12", True, 1.0),  # plain-text fraction, no box
    ("</think> \\boxed{1/3}", "\\frac{1}{2}", True, 0.0),
    ("</think> \\boxed{2/4}", "\\frac{1}{2}", True, 1.0),  # unsimplified fraction
    ("</think> \\boxed{50}", "50\\%", True, 1.0),  # percent sign in the gold is dropped
    ("</think> \\boxed{0.5}", "50\\%", True, 0.0),  # ... so 50% is not 0.5 for Math-Verify
    ("</think> \\boxed{42.0}", "42", True, 1.0),
    ("</think> \\boxed{\\sqrt{8}}", "2\\sqrt{2}", True, 1.0),
    ("</think> \\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", True, 1.0),
    ("</think> \\boxed{1+x^2}", "x^2+1", True, 1.0),
    ("</think> \\boxed{\\pi}", "\\pi", True, 1.0),
    ("</think> \\boxed{3.15}", "3.14", True, 0.0),
    ("</think>", "4", True, 0.0),  # empty answer
    ("", "4", True, 0.0),  # empty response: no </think>
    ("the answer is \\boxed{4}", "4", True, 0.0),  # missing </think> while required
    ("the answer is \\boxed{4}", "4", False, 1.0),  # ... graded as a whole when not required
    ("<think>dup</think> \\boxed{4}", "4", True, 1.0),  # the model reopened <think>: still one closing tag
    ("a</think> \\boxed{4} </think> \\boxed{5}", "4", True, 1.0),  # reference keeps split('</think>')[1]
    ("a</think> \\boxed{5} </think> \\boxed{4}", "4", True, 0.0),
    ("Let's think step by step. 6*7 = 42. \\boxed{42}", "42", False, 1.0),  # llama_base style
    ("</think> \\boxed{7}", "", True, 0.0),  # empty gold
]

ADVERSARIAL_ANSWERS = [
    "</think> \\boxed{9^{9^{9^{9}}}}",
    "</think> \\boxed{" + "(" * 2495 + "1" + ")" * 2495 + "}",  # ~5,000-character nested expression
    "</think> \\boxed{" + "\\frac{1}{" * 550 + "2" + "}" * 550 + "}",
    "</think> " + bytes(range(256)).decode("latin-1") * 8 + "\\boxed{\x00\xff}",  # binary junk
]


def test_grading_table_exact_rewards():
    got = [score_response(resp, gold, req, timeout_seconds=5) for resp, gold, req, _ in GRADING_TABLE]
    assert got == [expected for *_, expected in GRADING_TABLE]


def test_extract_answer_follows_reference_split():
    assert extract_answer("x</think>ans", True) == "ans"
    assert extract_answer("x</think>a</think>b", True) == "a"
    assert extract_answer("no closing tag", True) is None
    assert extract_answer("whole text", False) == "whole text"


@pytest.mark.parametrize("bad", [0.5, 0, -1, True, False, "5", None, 2.0])
def test_validate_timeout_rejects_non_positive_int(bad):
    with pytest.raises(ValueError, match="int >= 1"):
        validate_timeout(bad)
    with pytest.raises(ValueError):
        score_response("</think> 4", "4", True, bad)
    with pytest.raises(ValueError):
        GraderPool(num_workers=1, timeout_seconds=bad)


def test_validate_timeout_accepts_ints():
    assert validate_timeout(1) == 1 and validate_timeout(5) == 5


def test_scoring_off_the_main_thread_raises_instead_of_silently_zero():
    errors: list[BaseException] = []

    def grade_in_thread():
        try:
            score_response("</think> \\boxed{4}", "4", True, 5)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    thread = threading.Thread(target=grade_in_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])


@pytest.fixture(scope="module")
def pool():
    # Math-Verify's timeouts are wall-clock: 2 s leaves ordinary items headroom on an overloaded test machine.
    with GraderPool(num_workers=2, timeout_seconds=2, hard_deadline_seconds=8.0) as grader_pool:
        grader_pool.wait_ready()
        yield grader_pool


def test_pool_matches_serial_scoring_in_order(pool):
    items = [(resp, gold, req) for resp, gold, req, _ in GRADING_TABLE] * 3
    result = pool.grade(items)
    assert result.rewards == [expected for *_, expected in GRADING_TABLE] * 3
    assert result.n_timeouts_killed == 0 and result.n_worker_deaths == 0
    assert result.seconds > 0


def test_pool_submit_is_non_blocking_and_batches_interleave(pool):
    slow = pool.submit([("</think> \\boxed{9^{9^{9^{9}}}}", "3", True), ("</think> 7", "7", True)])
    fast = pool.submit([(f"</think> \\boxed{{{i}}}", str(i if i % 3 else i + 1), True) for i in range(30)])
    assert not slow.done.is_set()  # submit returned while a ~2 s item is still being graded
    fast_result = pool.result(fast)
    assert fast_result.rewards == [1.0 if i % 3 else 0.0 for i in range(30)]
    assert pool.result(slow).rewards == [0.0, 1.0]


def test_empty_and_format_only_batches_complete_immediately(pool):
    assert pool.grade([]).rewards == []
    result = pool.result(pool.submit([("no tag", "1", True)]), timeout=1.0)
    assert result.rewards == [0.0]


def test_adversarial_answers_finish_within_deadline_and_score_zero():
    with GraderPool(num_workers=2, timeout_seconds=1, hard_deadline_seconds=4.0) as grader_pool:
        grader_pool.wait_ready()
        items = [(ans, "3", True) for ans in ADVERSARIAL_ANSWERS] + [("</think> \\boxed{3}", "3", True)]
        start = time.perf_counter()
        result = grader_pool.grade(items)
        elapsed = time.perf_counter() - start
        assert result.rewards == [0.0] * len(ADVERSARIAL_ANSWERS) + [1.0]
        # Each item is bounded by the 4 s hard deadline; 5 items on 2 workers -> at most 3 rounds (+ slack).
        assert elapsed < 3 * 4.0 + 3.0, elapsed
        after = grader_pool.grade([("</think> \\boxed{\\frac{2}{3}}", "\\frac23", True), ("</think> 1", "2", True)])
        assert after.rewards == [1.0, 0.0]


def test_item_past_hard_deadline_is_killed_and_worker_replaced():
    # Math-Verify's own alarm is 5 s here, the hard deadline 1.5 s: the 9^9^9 parse (~5 s) gets killed.
    with GraderPool(num_workers=2, timeout_seconds=5, hard_deadline_seconds=1.5) as grader_pool:
        grader_pool.wait_ready()
        pids_before = set(grader_pool.worker_pids())
        items = [("</think> \\boxed{9^{9^{9}}}", "3", True)] + [(f"</think> {i}", str(i), True) for i in range(10)]
        start = time.perf_counter()
        result = grader_pool.grade(items)
        assert time.perf_counter() - start < 4.5
        assert result.rewards == [0.0] + [1.0] * 10
        assert result.n_timeouts_killed == 1 and result.n_worker_deaths == 0
        assert grader_pool.total_timeouts_killed == 1
        assert len(pids_before - set(grader_pool.worker_pids())) == 1
        assert grader_pool.grade([("</think> 9", "9", True)]).rewards == [1.0]


def test_stopped_worker_is_killed_at_the_deadline():
    with GraderPool(num_workers=2, timeout_seconds=3, hard_deadline_seconds=2.0) as grader_pool:
        grader_pool.wait_ready()
        stopped_pid = grader_pool.worker_pids()[0]
        os.kill(stopped_pid, signal.SIGSTOP)  # a real hang: the worker cannot even run its alarm handler
        items = [(f"</think> \\boxed{{{i}}}", str(i), True) for i in range(12)]
        result = grader_pool.grade(items)
        # Idle workers are served first, so the stopped worker holds the first chunk (items 0-2) and a later one:
        # item 0 (its oldest) scores 0, the others go back to the queue and are graded elsewhere.
        assert result.n_timeouts_killed == 1
        assert result.rewards == [0.0] + [1.0] * 11
        assert stopped_pid not in grader_pool.worker_pids()
        assert grader_pool.grade(items).rewards == [1.0] * 12


def test_worker_killed_between_batches_is_replaced():
    with GraderPool(num_workers=2, timeout_seconds=3, hard_deadline_seconds=8.0) as grader_pool:
        grader_pool.wait_ready()  # the victim must be a ready worker, so the next batch is dealt to it too
        items = [(resp, gold, req) for resp, gold, req, _ in GRADING_TABLE]
        expected = [e for *_, e in GRADING_TABLE]
        assert grader_pool.grade(items).rewards == expected
        victim = grader_pool.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        result = grader_pool.grade(items)
        assert result.rewards == expected  # an idle worker's death costs no item
        assert grader_pool.total_worker_deaths == 1
        assert victim not in grader_pool.worker_pids() and len(grader_pool.worker_pids()) == 2


def test_preemption_signals_to_the_whole_job_leave_the_pool_working():
    """Slurm signals every process of a step: the workers and the fork server must survive SIGTERM/SIGUSR1
    (the trainer handles them), so the step in flight finishes and a later replacement can still start."""
    from multiprocessing import forkserver

    with GraderPool(num_workers=2, timeout_seconds=3, hard_deadline_seconds=8.0) as grader_pool:
        grader_pool.wait_ready()
        items = [(resp, gold, req) for resp, gold, req, _ in GRADING_TABLE]
        expected = [e for *_, e in GRADING_TABLE]
        workers = grader_pool.worker_pids()
        server = forkserver._forkserver._forkserver_pid
        assert server is not None
        for pid in [*workers, server]:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.3)
        assert grader_pool.grade(items).rewards == expected
        assert grader_pool.worker_pids() == workers and grader_pool.total_worker_deaths == 0
        os.kill(workers[0], signal.SIGKILL)  # the replacement comes from the fork server that got the signals
        assert grader_pool.grade(items).rewards == expected
        assert grader_pool.total_worker_deaths == 1 and len(grader_pool.worker_pids()) == 2


def test_worker_killed_while_grading_is_replaced_and_counted():
    """Killed in the middle of a grading call, at a point fixed by the worker's own progress counter (not by a
    sleep): its chunk is [normal, slow, normal...] and a worker grades a chunk's items back to back, so once it
    reports 1 item done it is inside the slow item's Math-Verify call, which lasts the full 3 s timeout. The
    normal items get the same 3 s, far above their milliseconds even on a loaded machine."""
    with GraderPool(num_workers=1, timeout_seconds=3, hard_deadline_seconds=60.0) as grader_pool:
        grader_pool.wait_ready()
        slow = ("</think> \\boxed{9^{9^{9^{9}}}}", "3", True)  # Math-Verify times out on it: reward 0
        normal = [(f"</think> \\boxed{{{i}/7}}", f"\\frac{{{i}}}{{7}}", True) for i in range(1, 8)]
        handle = grader_pool.submit([normal[0], slow, *normal[1:]])
        victim = grader_pool.worker_pids()[0]
        end = time.monotonic() + 60.0
        while grader_pool.items_graded()[0] < 1:  # the event: the first item is done, the slow one is running
            assert time.monotonic() < end, "the worker never finished its first item"
            time.sleep(0.001)
        os.kill(victim, signal.SIGKILL)
        result = grader_pool.result(handle)
        # The slow item is retried once on the replacement (it may have died before reading it) and times out
        # there too; the items queued behind it go to the replacement: every reward is what it would have been.
        assert result.rewards == [1.0, 0.0] + [1.0] * (len(normal) - 1)
        assert result.n_worker_deaths == 1 and result.n_timeouts_killed == 0
        assert victim not in grader_pool.worker_pids()
        assert grader_pool.total_worker_deaths == 1 and grader_pool.total_timeouts_killed == 0


def test_items_held_by_a_killed_worker_are_regraded():
    with GraderPool(num_workers=2, timeout_seconds=3, hard_deadline_seconds=30.0) as grader_pool:
        grader_pool.wait_ready()
        victim = grader_pool.worker_pids()[0]
        os.kill(victim, signal.SIGSTOP)  # it will hold its two chunks without grading them
        items = [(f"</think> \\boxed{{{i}/7}}", f"\\frac{{{i + (i % 4 == 0)}}}{{7}}", True) for i in range(1, 13)]
        handle = grader_pool.submit(items)
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        result = grader_pool.result(handle)
        # Its oldest item is retried once and the one behind it re-queued: nothing is lost to the death.
        assert result.rewards == [0.0 if i % 4 == 0 else 1.0 for i in range(1, 13)]
        assert result.n_worker_deaths == 1 and result.n_timeouts_killed == 0
        assert victim not in grader_pool.worker_pids() and grader_pool.total_worker_deaths == 1


def test_closed_pool_rejects_work_and_fails_pending_batches():
    grader_pool = GraderPool(num_workers=1, timeout_seconds=2, hard_deadline_seconds=10.0)
    grader_pool.wait_ready()
    handle = grader_pool.submit([("</think> \\boxed{9^{9^{9^{9}}}}", "3", True), ("</think> 1", "1", True)])
    grader_pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        grader_pool.result(handle)
    with pytest.raises(RuntimeError, match="closed"):
        grader_pool.submit([("</think> 1", "1", True)])


def _job(gold: str, answer: str = "1") -> tuple:
    return (None, 0, answer, gold, 0)


def test_take_chunk_sizes_keep_a_gold_together_and_bound_a_busy_pipe():
    grouped = collections.deque(_job(f"g{i // 8}") for i in range(100))  # 12.5 groups of 8 sharing a gold
    assert [j[3] for j in take_chunk(grouped, n_ready=2, busy_chars=None)] == ["g0"] * 8 + ["g1"] * 8
    tail = collections.deque(_job(f"g{i // 8}") for i in range(12))  # target ceil(12 / 4) = 3, the gold's run is 8
    assert len(take_chunk(tail, n_ready=2, busy_chars=None)) == 8 and len(tail) == 4
    distinct = collections.deque(_job(str(i)) for i in range(12))
    assert [j[3] for j in take_chunk(distinct, n_ready=2, busy_chars=None)] == ["0", "1", "2"]
    huge = collections.deque([_job("3", "x" * 20_000), _job("3")])
    assert take_chunk(huge, n_ready=1, busy_chars=100) == []  # would not fit behind a busy worker's items
    assert len(take_chunk(huge, n_ready=1, busy_chars=None)) == 1  # an idle worker reads it at once


def test_slow_items_that_each_finish_in_time_are_not_killed():
    # One worker, one chunk of four ~1-1.5 s items (Math-Verify's own 1 s timeouts): the chunk takes longer than the
    # 3.5 s hard deadline, but every item finishes within it, and the deadline counts from the last finished item.
    with GraderPool(num_workers=1, timeout_seconds=1, hard_deadline_seconds=3.5) as grader_pool:
        grader_pool.wait_ready()
        pid = grader_pool.worker_pids()
        result = grader_pool.grade([("</think> \\boxed{9^{9^{9^{9}}}}", "3", True)] * 4 + [("</think> 1", "1", True)])
        assert result.seconds > 3.5  # the case under test: the chunk outlived the deadline
        assert result.rewards == [0.0] * 4 + [1.0]
        assert result.n_timeouts_killed == 0 and grader_pool.worker_pids() == pid


def test_kill_in_mid_chunk_keeps_the_finished_items_and_regrades_the_rest():
    with GraderPool(num_workers=1, timeout_seconds=5, hard_deadline_seconds=1.5) as grader_pool:
        grader_pool.wait_ready()
        ok = [(f"</think> \\boxed{{{i}}}", str(i if i != 4 else 5), True) for i in range(6)]
        items = ok[:2] + [("</think> \\boxed{9^{9^{9}}}", "3", True)] + ok[2:]  # one chunk of 7 (target 4, then 3)
        result = grader_pool.grade(items)
        assert result.rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        assert result.n_timeouts_killed == 1 and grader_pool.total_timeouts_killed == 1
