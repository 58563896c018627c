"""Convert one of our megatron checkpoints to a HuggingFace directory.

    python tools/convert_megatron_to_hf.py CKPT OUT_DIR [--dtype bf16|fp32] [--tokenizer DIR] [--shard-size-gb 5]

CKPT: a run dir (its newest complete checkpoint), a run's `checkpoints/` dir (its `latest` is followed), a step
dir (`model/` + `model_config.yaml`) or a converted checkpoint dir. Runs on CPU, reads the sharded checkpoint
tensor by tensor, any saved TP/PP/DP.
"""

from __future__ import annotations

import argparse
import sys

from exgrpo_megatron.checkpoint.layout import newest_if_run_dir
from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError
from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

EXIT_REFUSED = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--tokenizer", default=None,
                        help="copy tokenizer files from this dir, or 'char' for the built-in character tokenizer "
                        "(default: model.hf_path; a run trained with data.tokenizer=char exports 'char')")
    parser.add_argument("--shard-size-gb", type=float, default=5.0)
    parser.add_argument("--model-config", default=None, help="model_config.yaml when CKPT has none")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        files = convert_megatron_to_hf(newest_if_run_dir(args.ckpt), args.out_dir, args.dtype, args.tokenizer,
                                       args.shard_size_gb, args.model_config, progress=not args.no_progress)
    except (UnsupportedArchitectureError, FileNotFoundError) as exc:
        print(f"convert_megatron_to_hf: {args.ckpt}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"wrote {args.out_dir}: {len(files)} safetensors file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
