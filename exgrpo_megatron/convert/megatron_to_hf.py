"""Megatron torch_dist checkpoint (ours, saved at any TP/PP/DP) -> HF directory loadable by
`transformers.AutoModelForCausalLM.from_pretrained`. Reads the sharded checkpoint directly on CPU (no
process group), one layer at a time; vocabulary padding is trimmed. A LoRA run's adapters are merged into their
weights (W + B A alpha / rank, in fp32), so the HF model is the adapted policy.
"""

from __future__ import annotations

import json
import os

import torch

from exgrpo_megatron.config.paths import TRAINER_MANIFEST
from exgrpo_megatron.config.schema import LoraConfig, ModelConfig
from exgrpo_megatron.convert.dist_ckpt_io import DistCheckpointReader, LayeredCheckpointReader, sharded_key
from exgrpo_megatron.convert.hf_config import (
    MODEL_CONFIG_FILE,
    hf_config_from_model_config,
    load_model_config,
)
from exgrpo_megatron.convert.hf_io import ShardedSafetensorsWriter, copy_tokenizer_files
from exgrpo_megatron.convert.hf_mapping import megatron_param_names, megatron_shape, megatron_to_hf
from exgrpo_megatron.convert.hf_tokenizer import (
    RUN_TOKENIZER_CHAR,
    check_tokenizer_export,
    has_tokenizer,
    save_char_tokenizer,
    special_token_ids,
)
from exgrpo_megatron.model.param_layout import ADAPTER_SUFFIXES, VOCAB_PARALLEL, is_adapter, split_layer_name

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}
LATEST_FILE = "latest"
RUN_CONFIG_FILE = "config.yaml"  # the full resolved run config a trainer checkpoint carries


def resolve_checkpoint(path: str, model_config: str | None = None) -> tuple[str, str]:
    """(dist-checkpoint dir, model_config.yaml) for a run's `checkpoints/` dir (follows `latest`), a step dir
    (`model/` + `model_config.yaml`) or a bare dist-checkpoint dir."""
    if os.path.isfile(os.path.join(path, LATEST_FILE)):
        with open(os.path.join(path, LATEST_FILE)) as f:
            path = os.path.join(path, f.read().strip())
    if os.path.isfile(os.path.join(path, "model", ".metadata")):
        model_dir, cfg_candidates = os.path.join(path, "model"), [os.path.join(path, MODEL_CONFIG_FILE)]
    elif os.path.isfile(os.path.join(path, ".metadata")):
        model_dir = path
        cfg_candidates = [os.path.join(path, MODEL_CONFIG_FILE), os.path.join(os.path.dirname(path), MODEL_CONFIG_FILE)]
    else:
        raise FileNotFoundError(f"{path}: neither a checkpoints dir with '{LATEST_FILE}', a step dir with model/, "
                                "nor a torch_dist checkpoint")
    if model_config:
        cfg_candidates = [model_config]
    for c in cfg_candidates:
        if os.path.isfile(c):
            return model_dir, c
    raise FileNotFoundError(f"no {MODEL_CONFIG_FILE} for {model_dir} (looked at {cfg_candidates}); pass --model-config")


def checkpoint_reader(model_dir: str) -> DistCheckpointReader:
    """The reader of a checkpoint's model dir; for a LoRA checkpoint of the adapters alone, one that reads the base
    weights it names (verified first, checkpoint/lora_base.py) under the adapters."""
    from exgrpo_megatron.checkpoint.lora_base import BASE_KEY, verified_base_dir

    reader = DistCheckpointReader(model_dir)
    root = _read_json(os.path.join(os.path.dirname(model_dir), TRAINER_MANIFEST)) or {}
    if BASE_KEY not in root:
        return reader
    base = verified_base_dir(root[BASE_KEY], os.path.dirname(model_dir))
    return LayeredCheckpointReader([reader, DistCheckpointReader(str(base / "model"))])


def check_shapes(reader: DistCheckpointReader, cfg: ModelConfig) -> None:
    """Stored global shapes must match the ModelConfig (the vocabulary may carry any padding >= vocab_size)."""
    for name in megatron_param_names(cfg):
        key, index = sharded_key(name)
        stored = tuple(reader.tensor_meta(key).size)
        expected = megatron_shape(name, cfg)
        if index:
            leading, stored = stored[:len(index)], stored[len(index):]
            if leading != (cfg.num_layers, cfg.num_experts)[:len(index)]:
                raise ValueError(f"{key}: checkpoint has {leading} (layers, experts), model_config says "
                                 f"{cfg.num_layers} layers, {cfg.num_experts} experts")
        if name in VOCAB_PARALLEL:
            ok = stored[1:] == expected[1:] and stored[0] >= cfg.vocab_size
        else:
            ok = stored == expected
        if not ok:
            raise ValueError(f"{key}: stored shape {stored} incompatible with model_config (expected {expected})")


def checkpoint_lora(reader: DistCheckpointReader, model_dir: str) -> LoraConfig | None:
    """The `lora` settings of the run that saved the checkpoint when it holds adapters (model/lora.py; read from
    the run config the trainer checkpoint carries), else None."""
    if not any(is_adapter(k) for k in reader.metadata.state_dict_metadata if not k.startswith("optimizer")):
        return None
    run_config = os.path.join(os.path.dirname(model_dir), RUN_CONFIG_FILE)
    if not os.path.isfile(run_config):
        raise FileNotFoundError(f"{model_dir} holds LoRA adapters but {run_config} (their alpha and rank) is missing")
    from omegaconf import OmegaConf

    lora = OmegaConf.load(run_config).lora
    return LoraConfig(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                      targets=list(lora.targets), experts=bool(lora.experts))


def adapter_scale(reader: DistCheckpointReader, model_dir: str) -> float:
    """LoRA's alpha / rank when the checkpoint holds adapters, else 0."""
    lora = checkpoint_lora(reader, model_dir)
    return 0.0 if lora is None else lora.alpha / lora.rank  # model/lora.py's scale (its module imports megatron)


def merge_adapters(reader: DistCheckpointReader, name: str, full: torch.Tensor, scale: float) -> torch.Tensor:
    """The merged weight W + (B A) * alpha / rank of an adapted linear's `name` (fp32), else `full` unchanged."""
    if not name.endswith(".weight"):
        return full
    stem = name[: -len("weight")]
    if sharded_key(stem + "lora_a")[0] not in reader.metadata.state_dict_metadata:
        return full
    a, b = (reader.read_param(stem + f, dtype=torch.float32) for f in ADAPTER_SUFFIXES)
    return full + (b @ a) * scale


def _groups(cfg: ModelConfig) -> list[list[str]]:
    """Parameter names grouped so that one read fetches one layer (or one non-layer tensor)."""
    groups: dict[object, list[str]] = {}
    for name in megatron_param_names(cfg):
        layer, _ = split_layer_name(name)
        groups.setdefault(name if layer is None else layer, []).append(name)
    return list(groups.values())


def convert_megatron_to_hf(ckpt_path: str, out_dir: str, dtype: str = "bf16", tokenizer_dir: str | None = None,
                           shard_size_gb: float = 5.0, model_config: str | None = None,
                           progress: bool = True) -> list[str]:
    """Write config.json, generation_config.json, safetensors shards (+ index) and tokenizer files to `out_dir`.
    Tokenizer files come from `tokenizer_dir`, else from the model config's `hf_path` when it has them; the
    written directory's tokenizer is checked as `AutoTokenizer` loads it (hf_tokenizer.check_tokenizer_export)."""
    model_dir, cfg_path = resolve_checkpoint(ckpt_path, model_config)
    cfg = load_model_config(cfg_path)
    torch_dtype, dtype_name = DTYPES[dtype]
    reader = checkpoint_reader(model_dir)
    check_shapes(reader, cfg)
    scale = adapter_scale(reader, model_dir)
    writer = ShardedSafetensorsWriter(out_dir, int(shard_size_gb * 2**30))
    groups = _groups(cfg)
    if progress:
        from tqdm import tqdm

        groups = tqdm(groups, desc="megatron->hf", unit="group")
    for names in groups:
        requests = []
        for name in names:
            key, index = sharded_key(name)
            size = tuple(reader.tensor_meta(key).size)
            if not index:
                shape = (cfg.vocab_size, *size[1:]) if name in VOCAB_PARALLEL else size
                requests.append((key, (0,) * len(size), shape))
            else:
                requests.append((key, index + (0,) * (len(size) - len(index)), (1,) * len(index) + size[len(index):]))
        tensors = reader.read_regions(requests, dtype=torch.float32 if scale else torch_dtype)
        for name, t in zip(names, tensors, strict=True):
            n_leading = len(sharded_key(name)[1])
            full = t.reshape(t.shape[n_leading:])
            if scale:
                full = merge_adapters(reader, name, full, scale).to(torch_dtype)
            for hf_name, hf_tensor in megatron_to_hf(name, full, cfg):
                writer.add(hf_name, hf_tensor)
    files = writer.close()
    tok_src = tokenizer_dir or cfg.hf_path
    if tok_src == RUN_TOKENIZER_CHAR or (tok_src is None and _run_tokenizer(cfg_path) == RUN_TOKENIZER_CHAR):
        save_char_tokenizer(out_dir)  # the demo's built-in tokenizer, as HF files with the same ids
    elif tok_src and os.path.isdir(tok_src):
        copied = copy_tokenizer_files(tok_src, out_dir)
        if tokenizer_dir and not copied:
            raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files found")
    # Special-token ids: the original config's, else the exported tokenizer's (generate stops at eos_token_id).
    ids = special_token_ids(out_dir) if has_tokenizer(out_dir) else {}
    base = _read_json(os.path.join(cfg.hf_path, "config.json")) if cfg.hf_path else None
    hf_config = hf_config_from_model_config(cfg, dtype_name, base)
    for key, value in ids.items():
        hf_config.setdefault(key, value)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    gen = _read_json(os.path.join(cfg.hf_path, "generation_config.json")) if cfg.hf_path else None
    gen = dict(gen or {})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if gen.get(key) is None and hf_config.get(key) is not None:
            gen[key] = hf_config[key]
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    check_tokenizer_export(out_dir)  # AutoTokenizer (config.json now present) must give tokenizer.json's ids
    return files


def export_peft_adapter(ckpt_path: str, out_dir: str, dtype: str = "fp32", base_model: str | None = None,
                        model_config: str | None = None) -> list[str]:
    """Write a LoRA checkpoint's adapters as a PEFT adapter directory (convert/peft_adapter.py) for the HF model
    of its base weights (`base_model`, default the model config's hf_path, is recorded as
    base_model_name_or_path). Returns the PEFT modules written."""
    from exgrpo_megatron.convert.peft_adapter import (
        PeftAdapterError,
        adapted_weights,
        peft_adapter_config,
        peft_adapter_tensors,
        write_peft_adapter,
    )

    model_dir, cfg_path = resolve_checkpoint(ckpt_path, model_config)
    cfg = load_model_config(cfg_path)
    reader = checkpoint_reader(model_dir)
    check_shapes(reader, cfg)
    lora = checkpoint_lora(reader, model_dir)
    if lora is None:
        raise PeftAdapterError(f"{model_dir}: holds no LoRA adapters (export the model itself without --peft-adapter)")
    if lora.experts and cfg.num_experts:
        raise PeftAdapterError("lora.experts: the checkpoint has adapters on the MoE experts, which have no PEFT "
                               "adapter format (transformers holds a layer's experts as one 3-D parameter); export "
                               "the merged model instead")
    targets = [t for t in lora.targets if adapted_weights(cfg, [t])]
    tensors: dict[str, torch.Tensor] = {}
    for weight in adapted_weights(cfg, targets):
        stem = weight.removesuffix("weight")
        a, b = (reader.read_param(stem + f, dtype=torch.float32) for f in ADAPTER_SUFFIXES)
        for key, t in peft_adapter_tensors(weight, a, b, cfg):
            tensors[key] = t.to(DTYPES[dtype][0])
    write_peft_adapter(out_dir, tensors, peft_adapter_config(lora, targets, base_model or cfg.hf_path))
    return sorted({k.rsplit(".", 2)[0] for k in tensors})


def _run_tokenizer(model_config_path: str) -> str | None:
    """`data.tokenizer` of the run that saved the checkpoint (its config.yaml beside model_config.yaml)."""
    run_cfg = os.path.join(os.path.dirname(model_config_path), RUN_CONFIG_FILE)
    if not os.path.isfile(run_cfg):
        return None
    import yaml

    with open(run_cfg) as f:
        return ((yaml.safe_load(f) or {}).get("data") or {}).get("tokenizer")


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
