"""The CUDA-graph capture of the static decode step (rollout/static_decode.py; selected by rollout/decode_loop.py).

`capture_step` follows torch.cuda.graphs' documented recipe: warm-up runs on a side stream, one capture under
`torch.cuda.graph`, then `CUDAGraph.replay` per step. The step reads and writes only the preallocated decode slots'
buffers (static addresses), so a replay is the whole step with no Python and no host synchronisation. The warm-up
runs execute the step for real, so the captured bucket's rows are saved before and restored after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_RUNS = 2


def capture_step(step: Callable[[], None], rows: list[torch.Tensor], bucket: int) -> Callable[[], None]:
    """Capture `step` (one decode step over rows 0..bucket-1 of the slots whose per-row buffers are `rows`) as a CUDA
    graph; return its replay."""
    saved = [t[:bucket].clone() for t in rows]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t, kept in zip(rows, saved, strict=True):
        t[:bucket].copy_(kept)
    return graph.replay
