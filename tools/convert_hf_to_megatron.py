"""Convert a HuggingFace Qwen2 / Llama / Qwen3 directory to a megatron torch_dist checkpoint (run layout).

    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR [--tp N] [--pp N] [--dtype auto|fp32|bf16]

OUT_DIR receives `model/`, `model_config.yaml` and `manifest.json` (sizes + sha256s, verified on load); pass it
as `checkpoint.init_from=OUT_DIR`. The checkpoint is stored in the TP=1 layout; megatron reshards it to any
TP/PP when loading. A model the converter does not support (a family, an MoE layout, a sliding window, a TP that
does not divide the heads, ...) exits 2 with one line naming the HF key (or the option).
"""

from __future__ import annotations

import argparse
import sys

from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError
from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

EXIT_REFUSED = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--tp", type=int, default=1, help="target TP (validates divisibility, sets vocab padding)")
    parser.add_argument("--pp", type=int, default=1, help="target PP (validates divisibility)")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                        help="stored dtype; auto keeps the HF checkpoint's dtype")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = convert_hf_to_megatron(args.hf_dir, args.out_dir, args.tp, args.pp, args.dtype,
                                     progress=not args.no_progress)
    except (UnsupportedArchitectureError, FileNotFoundError, FileExistsError) as exc:
        print(f"convert_hf_to_megatron: {args.hf_dir}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"wrote {args.out_dir}/model, model_config.yaml and manifest.json ({cfg.family}, {cfg.num_layers} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
