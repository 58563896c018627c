"""Per-step experience-pool bookkeeping time and memory per stored token vs pool size.

One step = update(128 groups of K=8: stores, bucket moves, ~9% retirements) + sample(64) with trajectory
selection (a trivial scorer: the model forward is not bookkeeping) + stats(). Single process
(dp_group=None; the routing collectives are not timed). Synthetic trajectories of 64 tokens, 2 per
question when filling. Each pool size runs in a fresh process so its RSS delta is its own. Wall time
(perf_counter) and the process's CPU time (process_time) are both reported: on a shared, overloaded
box the CPU time is the better estimate of the cost on an idle core.

    python bench/experience_pool.py            # all sizes; writes bench/results/experience_pool.json
    python bench/experience_pool.py 1e3 1e4    # chosen sizes (still writes the JSON)

The response store of in-group / rescue replay (experience/response_store.py), `--response-store`: filled with r = 8
responses (token ids, recorded log-probs, reward, step) for each of N questions, then per step update(128 groups of
K = 8) + fetch(128 questions) + expire + stats; its RSS per stored token, its checkpoint payload, and the time per
step (bench/response_store.py; writes bench/results/response_store.json).

    python bench/experience_pool.py --response-store 1e4 1e5
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

K, BATCH, N_EXP, TOKENS, TRAJ_PER_QUESTION = 8, 128, 64, 64, 2
SIZES = [1_000, 10_000, 100_000, 200_000, 1_000_000]
TIMED_STEPS, WARMUP_STEPS = 40, 5
ORIGINAL_SECONDS_PER_STEP = {10_000: 0.36, 200_000: 195.0}  # the original (LUFFY) code's pool, measured per step


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_group(rng, qid: int, k: int, step: int):
    from exgrpo_megatron.experience import GroupOutcome

    ids = [rng.integers(0, 32000, TOKENS, dtype=np.int32) for _ in range(k)]
    lps = [rng.uniform(-3, 0, TOKENS).astype(np.float32) for _ in range(k)]
    return GroupOutcome(qid, k, K, ids, lps, step)


def cheap_scorer(qids, candidates):
    from exgrpo_megatron.experience import CandidateScores

    # stands in for the model forward (not bookkeeping): O(1) per candidate
    return [CandidateScores(mean_entropy=np.array([(t.step * 7919 + t.length) % 101 for t in c], dtype=np.float64))
            for c in candidates]


def measure(n_questions: int) -> dict:
    from exgrpo_megatron.experience import ShardedExperiencePool

    rng = np.random.default_rng(n_questions)
    rss_before = rss_bytes()
    pool = ShardedExperiencePool(K)
    fill_start = time.perf_counter()
    for lo in range(0, n_questions, 4096):
        pool.update([random_group(rng, q, TRAJ_PER_QUESTION, 0) for q in range(lo, min(lo + 4096, n_questions))])
    fill_seconds = time.perf_counter() - fill_start
    stats = pool.stats()
    rss_delta = rss_bytes() - rss_before

    ks = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8])
    k_probs = np.array([.15, .1, .1, .12, .12, .12, .1, .1, .09])
    per_step, cpu_ms, update_ms, sample_ms, next_new = [], [], [], [], n_questions
    for step in range(1, WARMUP_STEPS + TIMED_STEPS + 1):
        existing = rng.choice(n_questions, BATCH // 2, replace=False)
        new = np.arange(next_new, next_new + BATCH // 2)
        next_new += BATCH // 2
        groups = [random_group(rng, int(q), int(rng.choice(ks, p=k_probs)), step) for q in [*existing, *new]]
        start, cpu_start = time.perf_counter(), time.process_time()
        pool.update(groups)
        updated = time.perf_counter()
        replays = pool.sample(N_EXP, rng_seed=step, scorer=cheap_scorer)
        pool.stats()
        done, cpu_done = time.perf_counter(), time.process_time()
        assert len(replays) == N_EXP
        if step > WARMUP_STEPS:
            per_step.append(done - start)
            cpu_ms.append(1e3 * (cpu_done - cpu_start))
            update_ms.append(1e3 * (updated - start))
            sample_ms.append(1e3 * (done - updated))
    state_start = time.perf_counter()
    pool.state_dict()
    state_seconds = time.perf_counter() - state_start
    stats = pool.stats()
    return {
        "questions": n_questions,
        "trajectories": int(stats["experience/trajectories"]),
        "stored_tokens": int(stats["experience/stored_tokens"]),
        "retired": int(stats["experience/retired"]),
        "step_ms_median": 1e3 * float(np.median(per_step)),
        "step_ms_p90": 1e3 * float(np.percentile(per_step, 90)),
        "step_cpu_ms_median": float(np.median(cpu_ms)),  # process CPU time: robust to other jobs' load
        "update_ms_median": float(np.median(update_ms)),
        "sample_and_stats_ms_median": float(np.median(sample_ms)),
        "fill_seconds": fill_seconds,
        "state_dict_seconds": state_seconds,
        "rss_bytes_per_stored_token": rss_delta / (TRAJ_PER_QUESTION * TOKENS * n_questions),
        "payload_bytes_per_stored_token": 8,  # int32 token id + float32 behaviour log-prob
        "original_seconds_per_step": ORIGINAL_SECONDS_PER_STEP.get(n_questions),
    }


def _child(measure_fn: Callable[[int], dict], n_questions: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue.put(measure_fn(n_questions))


def each_in_fresh_process(measure_fn: Callable[[int], dict], sizes: list[int]) -> Iterator[dict]:
    """`measure_fn(n)` for each size in a fresh (spawned, one-thread) process, so that its RSS delta is its own."""
    ctx = mp.get_context("spawn")
    for n in sizes:
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(measure_fn, n, queue))
        proc.start()
        row = queue.get()
        proc.join()
        yield row


def write_result(name: str, fields: dict, rows: list[dict]) -> None:
    """bench/results/<name>.json: the bench's fields, this machine and the rows."""
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared, loaded)"
    path = Path(__file__).parent / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**fields, "machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    if sys.argv[1:2] == ["--response-store"]:
        from bench.response_store import main as response_store_main

        response_store_main([int(float(a)) for a in sys.argv[2:]])
        return
    rows = []
    header = f"{'questions':>10} {'traj':>9} {'step ms (med/p90)':>18} {'cpu ms':>7} {'update ms':>9} " \
             f"{'sample ms':>9} {'B/token RSS':>11} {'fill s':>7} {'state s':>7} {'original s/step':>15}"
    print(header)
    sizes = [int(float(a)) for a in sys.argv[1:]] or SIZES  # e.g. `python bench/experience_pool.py 1e3 1e4`
    for n, row in zip(sizes, each_in_fresh_process(measure, sizes), strict=True):
        rows.append(row)
        orig = row["original_seconds_per_step"]
        print(f"{n:>10} {row['trajectories']:>9} {row['step_ms_median']:>9.2f}/{row['step_ms_p90']:<8.2f} "
              f"{row['step_cpu_ms_median']:>7.2f} {row['update_ms_median']:>9.2f} "
              f"{row['sample_and_stats_ms_median']:>9.2f} "
              f"{row['rss_bytes_per_stored_token']:>11.1f} "
              f"{row['fill_seconds']:>7.1f} {row['state_dict_seconds']:>7.2f} {'' if orig is None else orig:>15}")
    write_result("experience_pool", {
        "description": "per-step bookkeeping (update 128 groups of 8 + sample 64 with selection + stats), single "
                       "process; synthetic 64-token trajectories, 2 per question at fill",
        "trajectory_tokens": TOKENS, "group_size": K, "batch_groups": BATCH, "n_exp": N_EXP}, rows)


if __name__ == "__main__":
    main()
