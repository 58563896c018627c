"""The precision `model.params_dtype=auto` gives a CPU run: bf16 where the CPU has bf16 matrix units and the
model is large enough for them to pay, fp32 elsewhere (docs/precision.md has the measurements).

A bf16 GEMM runs on AMX-BF16 tiles or AVX512-BF16 dot products (oneDNN picks them); without either, torch
emulates bf16 through fp32 and a bf16 model is only slower. With them, the GEMMs of a small model are too small
to gain: at the demo's hidden size 128 the casts, the mixed-precision optimizer's fp32 main copy and the
unfused element-wise ops cost more than the faster GEMMs save. `BF16_MIN_HIDDEN_SIZE` is the measured
crossover (bench/demo_step.py, bench/real_model_e2e.py with --dtypes).
"""

from __future__ import annotations

from functools import lru_cache

# (cpuinfo flag, the name printed at start-up), best first
BF16_MATRIX_UNITS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
# auto = bf16 on CPU from this hidden size on: the demo (128) measured slower in bf16, SmolLM2-135M (576) faster
BF16_MIN_HIDDEN_SIZE = 512


def bf16_matrix_unit(flags: frozenset[str]) -> str | None:
    """The CPU's bf16 matrix unit named from its cpuinfo flags (AMX-BF16 before AVX512-BF16), or None."""
    for flag, name in BF16_MATRIX_UNITS:
        if flag in flags:
            return name
    return None


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's `flags` line of /proc/cpuinfo (empty where the file does not exist)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def this_cpu_bf16_unit() -> str | None:
    """`bf16_matrix_unit` of this machine's CPU (read once per process)."""
    return bf16_matrix_unit(read_cpu_flags())


def cpu_auto_is_bf16(bf16_unit: str | None, hidden_size: int) -> bool:
    """auto on CPU: bf16 exactly where a bf16 matrix unit exists and the model is large enough to gain from it."""
    return bf16_unit is not None and hidden_size >= BF16_MIN_HIDDEN_SIZE


def cpu_precision_line(params_dtype: str, bf16_unit: str | None, hidden_size: int, resolved_bf16: bool) -> str:
    """The start-up line that says which precision a CPU run trains and generates in, and why."""
    unit = f"bf16 matrix unit {bf16_unit}" if bf16_unit else "no bf16 matrix unit (no amx_bf16/avx512_bf16 flag)"
    chosen = "bf16 (fp32 main params and Adam state)" if resolved_bf16 else "fp32"
    if params_dtype != "auto":
        why = f"model.params_dtype={params_dtype}"
    elif bf16_unit is None:
        why = "auto: no bf16 matrix unit"
    else:
        relation = ">=" if hidden_size >= BF16_MIN_HIDDEN_SIZE else "<"
        why = f"auto: hidden size {hidden_size} {relation} {BF16_MIN_HIDDEN_SIZE}"
    return f"CPU precision: {chosen}; {unit}; {why}"
