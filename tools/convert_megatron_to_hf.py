"""Convert one of our megatron checkpoints to a HuggingFace directory.

    python tools/convert_megatron_to_hf.py CKPT OUT_DIR [--dtype bf16|fp32] [--tokenizer DIR] [--shard-size-gb 5]
    python tools/convert_megatron_to_hf.py CKPT OUT_DIR --peft-adapter [--base-model HF_DIR_OR_ID] [--dtype fp32]

CKPT: a run dir (its newest complete checkpoint), a run's `checkpoints/` dir (its `latest` is followed), a step
dir (`model/` + `model_config.yaml`) or a converted checkpoint dir. Runs on CPU, reads the sharded checkpoint
tensor by tensor, any saved TP/PP/DP. A LoRA checkpoint exports with its adapters merged into the weights, or
with --peft-adapter as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for
`peft.PeftModel.from_pretrained(base, OUT_DIR)`.
"""

from __future__ import annotations

import argparse
import sys

from exgrpo_megatron.checkpoint.layout import newest_if_run_dir
from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError
from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf, export_peft_adapter
from exgrpo_megatron.convert.peft_adapter import PeftAdapterError

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
    parser.add_argument("--peft-adapter", action="store_true",
                        help="write the LoRA adapters as a PEFT adapter directory instead of the merged model")
    parser.add_argument("--base-model", default=None,
                        help="--peft-adapter: the adapter's base_model_name_or_path (default: model.hf_path)")
    args = parser.parse_args(argv)
    try:
        if args.peft_adapter:
            modules = export_peft_adapter(newest_if_run_dir(args.ckpt), args.out_dir, args.dtype, args.base_model,
                                          args.model_config)
            print(f"wrote {args.out_dir}: a PEFT adapter on {len(modules)} modules")
            return 0
        files = convert_megatron_to_hf(newest_if_run_dir(args.ckpt), args.out_dir, args.dtype, args.tokenizer,
                                       args.shard_size_gb, args.model_config, progress=not args.no_progress)
    except (UnsupportedArchitectureError, FileNotFoundError, PeftAdapterError) as exc:
        print(f"convert_megatron_to_hf: {args.ckpt}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"wrote {args.out_dir}: {len(files)} safetensors file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
