"""Decode attention over the KV cache: the engine's two implementations (rollout/kv_decode.py) timed side by side.

`explicit` (matmul, fp32 masked softmax, matmul) and `fused` (torch's scaled_dot_product_attention) at a decode
step of the SmolLM2-135M shape: 32 rows, 9 query heads in 3 KV groups, head dim 64, one query against T cached
positions (10% of them masked as padding), fp32 and bf16. One thread; per (dtype, T, implementation) the best of
5 batches of 200 calls by process CPU time (a shared box: CPU time excludes the time the process waits for a core).
`cache_attention` uses `fused` in bf16/fp16 and `explicit` in fp32 on the CPU, by these numbers; on a GPU the check
pack (bench/gpu_check.py, section `decode_attention`) times both with `device_paths` at the 1.5B decode shape.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/cache_attention.py`` (writes bench/results/cache_attention.json).
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from exgrpo_megatron.rollout.kv_decode import (
    cache_attention,
    cache_attention_path,
    explicit_cache_attention,
    fused_cache_attention,
)

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cache_attention.json")
ROWS, HEADS, GROUPS, HEAD_DIM = 32, 9, 3, 64


def cpu_microseconds(fn, calls: int = 200, batches: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(batches):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def device_paths(device: str, rows: int, heads: int, groups: int, head_dim: int, cached: int,
                 dtype: torch.dtype, calls: int = 50) -> dict:
    """Both paths and the engine's choice (`cache_attention`) at one decode shape on `device`, by wall time
    (synchronised): the mean microseconds of `calls` calls after a warm-up, and the largest |difference| between
    the two paths' outputs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, rows, heads, head_dim, generator=gen).to(device, dtype)
    keys, values = (torch.randn(rows, groups, cached, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    mask = torch.rand(rows, 1, 1, cached, generator=gen) > 0.1
    mask[..., -1] = True
    args = (q, keys, values, mask.to(device), 1 / math.sqrt(head_dim))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def wall_us(fn) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls * 1e6

    out = {"rows": rows, "heads": heads, "groups": groups, "head_dim": head_dim, "cached_positions": cached,
           "dtype": str(dtype).removeprefix("torch."),
           "explicit_us": wall_us(lambda: explicit_cache_attention(*args)),
           "fused_us": wall_us(lambda: fused_cache_attention(*args)),
           "engine_us": wall_us(lambda: cache_attention(*args)),
           "max_abs_diff": (explicit_cache_attention(*args).float() - fused_cache_attention(*args).float()
                            ).abs().max().item()}
    out["engine_path"] = cache_attention_path(q.dtype, q.device.type)
    return out


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for cached in (100, 200, 300):
        q = torch.randn(1, ROWS, HEADS, HEAD_DIM, generator=gen)
        keys, values = (torch.randn(ROWS, GROUPS, cached, HEAD_DIM, generator=gen) for _ in range(2))
        mask = torch.rand(ROWS, 1, 1, cached, generator=gen) > 0.1
        mask[..., -1] = True  # the query's own position
        for dtype in (torch.float32, torch.bfloat16):
            args = (q.to(dtype), keys.to(dtype), values.to(dtype), mask, 1 / math.sqrt(HEAD_DIM))
            row = {"cached_positions": cached, "dtype": str(dtype).removeprefix("torch."),
                   "explicit_us": cpu_microseconds(lambda a=args: explicit_cache_attention(*a)),
                   "fused_us": cpu_microseconds(lambda a=args: fused_cache_attention(*a))}
            row["explicit_over_fused"] = row["explicit_us"] / row["fused_us"]
            rows.append(row)
            print(row)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"threads": 1, "load_average": os.getloadavg(), "cpu_count": os.cpu_count(), "rows": rows}, f,
                  indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
