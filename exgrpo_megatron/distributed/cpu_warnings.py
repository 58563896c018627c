"""A quiet start on CPU: the known-harmless third-party warnings are filtered, each by message AND module.

On CPU (no CUDA) megatron-core warns once per module that Transformer Engine / Apex are missing and falls
back to torch (optimizers, norms, multi-tensor ops): that is the intended CPU path (README, install
paths), not a problem, and the wall of these lines hid the ones a user needs. So
:func:`filter_known_cpu_warnings` drops exactly those, and only where megatron-core raises them: every
filter names a message pattern and the warning's module, so the same text from elsewhere, and every
other warning, still shows. On GPU nothing is filtered (a missing Transformer Engine there is news).
It is installed by :func:`exgrpo_megatron.distributed.cpu_shims.apply` (the one place CPU shims go) and
replaced by :func:`cpu_run_banner`, one line that says what the fallbacks mean.
"""

from __future__ import annotations

import warnings

# (message regex, module regex): `warnings.filterwarnings` matches `message` at the start of the text and
# `module` against the full dotted name of the module that called warnings.warn.
KNOWN_CPU_WARNINGS: tuple[tuple[str, str], ...] = (
    # megatron/core/{optimizer,optimizer.optimizer,optimizer.clip_grads,distributed.fsdp...mixed_precision}
    (r"Transformer Engine and Apex are not installed\. Falling back to ", r"megatron\.core\."),
    # megatron/core/models/backends.py and models/gpt/gpt_layer_specs.py (the local layer spec)
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\.models\."),
    # megatron/core/transformer/transformer_config.py, raised by its own default cuda_graph_scope (no graphs on CPU)
    (r"full scope is deprecated\. Use empty cuda_graph_scope", r"megatron\.core\.transformer\.transformer_config$"),
)
# FutureWarnings torch raises on every dist-checkpoint load (the warm-start cache, init_from, resume) through
# megatron-core's dist_checkpointing: deprecations of APIs megatron-core 0.16 calls, nothing a user can act on.
KNOWN_CHECKPOINT_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing\."),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", r"torch\.distributed\.checkpoint\."),
)


def filter_known_cpu_warnings() -> None:
    """Ignore :data:`KNOWN_CPU_WARNINGS` (UserWarning) and :data:`KNOWN_CHECKPOINT_WARNINGS` (FutureWarning), each by
    message and module; idempotent."""
    for message, module in KNOWN_CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for message, module in KNOWN_CHECKPOINT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)


def cpu_run_banner(layer_spec: str) -> str:
    """The one line that replaces the filtered warnings."""
    return (f"CPU run: gloo process groups, {layer_spec} layer spec, no Transformer Engine/Apex "
            "(megatron-core's torch fallbacks for optimizer, norms and multi-tensor ops)")
