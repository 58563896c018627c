"""Whether this machine can run Transformer Engine's layers (what `model.layer_spec=auto` resolves by)."""

from __future__ import annotations


def transformer_engine_available() -> bool:
    """True when TE imports cleanly and CUDA is present. A half-installed TE raises RuntimeError,
    not ImportError, so both are caught."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True
