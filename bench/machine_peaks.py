"""What this machine can do, measured in the same run as a benchmark: the fp32 and bf16 GEMM peaks and the memory
bandwidth, and the rooflines built from them (the fraction of them a benchmark reached goes into its JSON).

    from machine_peaks import measure_peaks, decode_roofline_tokens_per_s
    peaks = measure_peaks(threads=1)   # {"fp32_peak_gflops": ..., "bf16_peak_gflops": ..., "mem_bandwidth_gbs": ...}

The GEMM peak is the best of square products (n = 512, 1024, 2048; the best of a few repeats each: the box is
shared, so the best run is the one least disturbed); the bandwidth is the best of a few 256 MiB copies
(read + write bytes / time). `clock="cpu"` times them by the process's CPU time instead of the wall clock: with one
thread on a loaded box that is the time the work took while it ran (preemption excluded), the clock to compare a
single-threaded benchmark's CPU time with. `python bench/machine_peaks.py [--threads N]` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

GEMM_SIZES = (512, 1024, 2048)
COPY_BYTES = 256 << 20


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _best_seconds(fn, repeats: int, clock: str = "wall") -> float:
    now = CLOCKS[clock]
    fn()  # warm-up: oneDNN picks and caches its kernel on the first call
    best = float("inf")
    for _ in range(repeats):
        start = now()
        fn()
        best = min(best, now() - start)
    return best


def gemm_peak_gflops(dtype, sizes=GEMM_SIZES, repeats: int = 3, clock: str = "wall") -> float:
    """Best GFLOP/s of an n x n x n matmul (2 n^3 FLOPs) in `dtype` over `sizes`."""
    import torch

    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        best = max(best, 2 * n ** 3 / _best_seconds(lambda a=a, b=b: torch.mm(a, b), repeats, clock) / 1e9)
    return best


def memory_bandwidth_gbs(nbytes: int = COPY_BYTES, repeats: int = 3, clock: str = "wall") -> float:
    """Best GB/s of a large tensor copy, counting the bytes read and the bytes written."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats, clock) / 1e9


def measure_peaks(threads: int | None = None, clock: str = "wall") -> dict:
    """fp32 and bf16 GEMM peaks and memory bandwidth with `threads` intra-op threads (None: torch's current),
    timed by `clock` (CLOCKS)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return {"threads": torch.get_num_threads(), "clock": clock,
                "fp32_peak_gflops": gemm_peak_gflops(torch.float32, clock=clock),
                "bf16_peak_gflops": gemm_peak_gflops(torch.bfloat16, clock=clock),
                "mem_bandwidth_gbs": memory_bandwidth_gbs(clock=clock), "load_average": os.getloadavg()}
    finally:
        torch.set_num_threads(before)


def decode_roofline_tokens_per_s(weight_bytes: float, flops_per_token: float, batch: int, peaks: dict,
                                 dtype: str) -> dict:
    """The decode roofline: one step of `batch` sequences reads every weight once (memory bound: bandwidth /
    weight bytes steps per second) and does batch x flops_per_token FLOPs (compute bound: the dtype's GEMM peak);
    tokens/s is batch x the slower of the two step rates."""
    memory_steps = peaks["mem_bandwidth_gbs"] * 1e9 / weight_bytes
    compute_steps = peaks[f"{dtype}_peak_gflops"] * 1e9 / (batch * flops_per_token)
    bound = "memory" if memory_steps < compute_steps else "compute"
    return {"roofline_tokens_per_s": batch * min(memory_steps, compute_steps), "bound": bound,
            "memory_bound_tokens_per_s": batch * memory_steps, "compute_bound_tokens_per_s": batch * compute_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    print(json.dumps(measure_peaks(ap.parse_args().threads), indent=1))


if __name__ == "__main__":
    main()
