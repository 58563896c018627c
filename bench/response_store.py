"""The response store's size and per-step bookkeeping vs questions held (run through bench/experience_pool.py
--response-store). Each size runs in a fresh process so its RSS delta is its own; single process (dp_group=None).

What one question costs: r = 8 stored responses of TOKENS tokens, each an int32 token id + a float32 recorded
log-prob per token (8 bytes/token of payload) + its reward (float64) and step (int64) + the Python objects around
them (the RSS delta minus the payload is that overhead).
"""

from __future__ import annotations

import time

import numpy as np

from bench.experience_pool import each_in_fresh_process, rss_bytes, write_result

K, BATCH, R, TOKENS = 8, 128, 8, 64
SIZES = [10_000, 100_000]
TIMED_STEPS, WARMUP_STEPS = 30, 3


def responses(rng, n: int, step: int) -> list:
    from exgrpo_megatron.experience.response_store import StoredResponse

    return [StoredResponse(rng.integers(0, 32000, TOKENS, dtype=np.int32),
                           rng.uniform(-3, 0, TOKENS).astype(np.float32), float(rng.integers(0, 2)), step)
            for _ in range(n)]


def measure(n_questions: int) -> dict:
    from exgrpo_megatron.experience.response_store import ResponseReplay, ResponseStore

    rng = np.random.default_rng(n_questions)
    rss_before = rss_bytes()
    store = ResponseStore(ResponseReplay(per_question=R, failures=True), max_age_steps=0)
    fill_start = time.perf_counter()
    for lo in range(0, n_questions, 4096):
        store.update([(q, responses(rng, R, 0)) for q in range(lo, min(lo + 4096, n_questions))])
    fill_seconds = time.perf_counter() - fill_start
    stored_tokens = int(store.stats()["responses/stored_tokens"])
    rss_delta = rss_bytes() - rss_before
    per_step, cpu_ms = [], []
    for step in range(1, WARMUP_STEPS + TIMED_STEPS + 1):
        qids = rng.choice(n_questions, BATCH, replace=False).tolist()
        groups = [(q, responses(rng, K, step)) for q in qids]
        start, cpu_start = time.perf_counter(), time.process_time()
        fetched = store.fetch(qids)
        store.update(groups)
        store.expire(step)
        store.stats()
        done, cpu_done = time.perf_counter(), time.process_time()
        assert len(fetched) == BATCH
        if step > WARMUP_STEPS:
            per_step.append(done - start)
            cpu_ms.append(1e3 * (cpu_done - cpu_start))
    state_start = time.perf_counter()
    state = store.state_dict()
    state_seconds = time.perf_counter() - state_start
    state_bytes = int(sum(a.nbytes for a in state["arrays"].values()))
    return {
        "questions": n_questions, "responses": store.num_responses, "stored_tokens": stored_tokens,
        "rss_bytes": rss_delta, "rss_bytes_per_stored_token": rss_delta / stored_tokens,
        "payload_bytes_per_stored_token": 8,  # int32 token id + float32 recorded log-prob
        "checkpoint_bytes": state_bytes, "checkpoint_bytes_per_stored_token": state_bytes / stored_tokens,
        "step_ms_median": 1e3 * float(np.median(per_step)), "step_cpu_ms_median": float(np.median(cpu_ms)),
        "fill_seconds": fill_seconds, "state_dict_seconds": state_seconds,
    }


def main(sizes: list[int]) -> None:
    rows = []
    print(f"{'questions':>10} {'responses':>10} {'RSS MB':>8} {'B/token RSS':>11} {'ckpt MB':>8} "
          f"{'step ms':>8} {'cpu ms':>7} {'state s':>7}")
    sizes = sizes or SIZES
    for n, row in zip(sizes, each_in_fresh_process(measure, sizes), strict=True):
        rows.append(row)
        print(f"{n:>10} {row['responses']:>10} {row['rss_bytes'] / 2**20:>8.1f} "
              f"{row['rss_bytes_per_stored_token']:>11.1f} {row['checkpoint_bytes'] / 2**20:>8.1f} "
              f"{row['step_ms_median']:>8.2f} {row['step_cpu_ms_median']:>7.2f} {row['state_dict_seconds']:>7.2f}")
    write_result("response_store", {
        "description": "response store (in-group / rescue replay): r responses per question, each TOKENS tokens; per "
                       "step fetch(128) + update(128 groups of 8) + expire + stats; single process",
        "responses_per_question": R, "response_tokens": TOKENS, "group_size": K, "batch_groups": BATCH}, rows)
