"""Which decode loop and step the megatron engine runs (config keys rollout.decode_loop, rollout.compile_decode,
rollout.cuda_graphs), resolved by `continuous_settings`:
* decode_loop: "chunked" (length-sorted chunks, rows dropped as they finish: the default), "continuous"
  (rollout/continuous.py; refused with the reason for a model the static step does not run) or "auto"
  (continuous on CUDA where the model allows it, else chunked);
* the step of the continuous loop: "cuda_graph" when cuda_graphs is "true", or "auto" on CUDA (captured by
  rollout/cuda_graph_step.py); else "compile" when compile_decode; else "eager". cuda_graphs "true" off CUDA is
  refused.
"""

from __future__ import annotations

from exgrpo_megatron.rollout.static_decode import static_unsupported_reason

DECODE_LOOPS = ("auto", "chunked", "continuous")
CUDA_GRAPH_CHOICES = ("auto", "true", "false")


def continuous_settings(model, decode_loop: str, compile_decode: bool, cuda_graphs: str,
                        decode_impl: str) -> str | None:
    """The continuous loop's step mode ("eager", "compile", "cuda_graph"), or None for the chunked loop."""
    if decode_loop not in DECODE_LOOPS:
        raise ValueError(f"decode_loop must be one of {DECODE_LOOPS}, got {decode_loop!r}")
    if str(cuda_graphs).lower() not in CUDA_GRAPH_CHOICES:
        raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_CHOICES}, got {cuda_graphs!r}")
    graphs = str(cuda_graphs).lower()
    on_cuda = next(model.parameters()).device.type == "cuda"
    if graphs == "true" and not on_cuda:
        raise ValueError("cuda_graphs=true needs the model on a CUDA device")
    why = "decode_impl='megatron'" if decode_impl == "megatron" else static_unsupported_reason(model)
    if decode_loop == "continuous" and why is not None:
        raise ValueError(f"decode_loop='continuous' does not support this model: {why}")
    if decode_loop == "chunked" or (decode_loop == "auto" and (why is not None or not on_cuda)):
        return None
    if graphs == "true" or (graphs == "auto" and on_cuda):
        return "cuda_graph"
    return "compile" if compile_decode else "eager"
