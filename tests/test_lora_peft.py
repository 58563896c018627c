"""LoRA adapters <-> PEFT adapter directories (convert/peft_adapter.py), against transformers' own model classes and
the `peft` library: adapters on a converted HF base (Qwen2 and Qwen3 at TP=2: linear_qkv's group-interleaved and
linear_fc1's TP-interleaved B; Qwen3-MoE attention only) export to a directory that `PeftModel.from_pretrained`
loads with our logits; an adapter trained with peft (separate A per projection) loads into our fused linears with
PeftModel's logits; what does not fit is refused naming the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from exgrpo_megatron.config.schema import LoraConfig
from tests.helpers.hf_families import make_hf_model, perturb
from tests.helpers.multirank import run_on_ranks
from tests.test_convert import _forward_logits, _tokens
from tests.test_moe_convert import SHAPE as MOE_SHAPE

pytest.importorskip("peft")
RANK, ALPHA = 4, 16.0  # scale 4: applied twice (16) or not at all (1) moves the logits far past the tolerance
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
CASES = {  # case -> (HF family, TP, lora settings)
    "qwen2": ("qwen2", 2, dict(targets=ALL)),
    "qwen3": ("qwen3", 2, dict(targets=["linear_qkv", "linear_fc1"])),  # a subset: the fused linears only
    "qwen3_moe": ("qwen3_moe", 1, dict(targets=ALL)),  # attention only (lora.experts false)
    "qwen3_moe_experts": ("qwen3_moe", 1, dict(targets=ALL, experts=True)),
}


def _adapted_model(mg_dir: str, tp: int, lora: LoraConfig):
    from exgrpo_megatron.checkpoint.weights import load_model_weights
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.convert.hf_config import load_model_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    init_distributed(tp, 1, seed=5)
    cfg = load_model_config(os.path.join(mg_dir, "model_config.yaml"))
    cfg.params_dtype, cfg.layer_spec = "fp32", "local"
    model = build_gpt_model(cfg, ParallelConfig(tensor_model_parallel_size=tp), lora=lora).eval()
    load_model_weights(mg_dir, [model])  # the base: the converted HF model; the adapters keep their init
    return cfg, model


def _export_worker(mg_dir: str, step_dir: str, tp: int, lora: LoraConfig) -> torch.Tensor | None:
    """The base with random adapters (A and B non-zero), saved as a LoRA checkpoint step dir; its logits."""
    from megatron.core import parallel_state as ps
    from omegaconf import OmegaConf

    from exgrpo_megatron.checkpoint import model_config_to_yaml
    from exgrpo_megatron.checkpoint.weights import save_model_weights
    from exgrpo_megatron.model.lora import load_adapters
    from exgrpo_megatron.model.param_layout import is_adapter
    from tests.helpers.gather import full_tensors

    cfg, model = _adapted_model(mg_dir, tp, lora)
    g = torch.Generator().manual_seed(3)
    adapters = {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in sorted(full_tensors([model]).items())
                if is_adapter(n)}
    load_adapters([model], adapters)
    save_model_weights(step_dir, [model], model_config_yaml=model_config_to_yaml(cfg))
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        OmegaConf.save(OmegaConf.create({"lora": OmegaConf.structured(lora)}), os.path.join(step_dir, "config.yaml"))
    return _forward_logits(model, _tokens(200), 200)


def _import_worker(mg_dir: str, peft_dir: str, tp: int, lora: LoraConfig) -> torch.Tensor | str | None:
    """Our logits with the adapters of a PEFT directory, or the refusal's message."""
    from exgrpo_megatron.convert.peft_adapter import PeftAdapterError, megatron_adapters_from_peft
    from exgrpo_megatron.model.lora import load_adapters

    cfg, model = _adapted_model(mg_dir, tp, lora)
    try:
        load_adapters([model], megatron_adapters_from_peft(peft_dir, cfg, lora))
    except PeftAdapterError as exc:
        return str(exc)
    return _forward_logits(model, _tokens(200), 200)


def _hf_base(family: str, hf_dir: str):
    if family != "qwen3_moe":
        return make_hf_model(family, hf_dir)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_SHAPE)).float().eval()
    perturb(hf, 1)
    hf.save_pretrained(hf_dir)
    return hf


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (HF dir, its megatron conversion)."""
    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("peft_bases")
    out = {}
    for family in ("qwen2", "qwen3", "qwen3_moe"):
        hf_dir, mg_dir = str(root / f"hf_{family}"), str(root / f"mg_{family}")
        _hf_base(family, hf_dir)
        convert_hf_to_megatron(hf_dir, mg_dir, dtype="fp32", progress=False)
        out[family] = (hf_dir, mg_dir)
    return out


def _peft_logits(hf_dir: str, adapter_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the base's logits, PeftModel's logits with the adapter) in transformers, fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(_tokens(200)).logits
        adapted = PeftModel.from_pretrained(base, adapter_dir).eval()(_tokens(200)).logits
    return plain, adapted


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "qwen3_moe"])
def test_peft_export_loads_in_peft_with_our_logits(bases, tmp_path, case):
    import json

    from exgrpo_megatron.convert.megatron_to_hf import export_peft_adapter

    family, tp, settings = CASES[case]
    hf_dir, mg_dir = bases[family]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, **settings)
    step = str(tmp_path / "step_00000001")
    ours = run_on_ranks(_export_worker, 2, args=(mg_dir, step, tp, lora))[0]
    modules = export_peft_adapter(step, str(tmp_path / "peft"), dtype="fp32", base_model=hf_dir)
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["base_model_name_or_path"]) == (RANK, ALPHA, hf_dir)
    plain, adapted = _peft_logits(hf_dir, str(tmp_path / "peft"))
    assert (ours - plain).abs().max() > 0.1  # the adapters change the function
    gap = float((adapted - ours).abs().max() / ours.abs().max())
    assert gap < 1e-5, gap
    layers = 2
    per_layer = {"qwen2": 7, "qwen3": 5, "qwen3_moe": 4}[case]  # q k v o gate up down | q k v gate up | q k v o
    assert len(modules) == layers * per_layer, modules


def test_adapters_on_experts_export_is_refused_naming_lora_experts(bases, tmp_path):
    import subprocess
    import sys

    family, tp, settings = CASES["qwen3_moe_experts"]
    step = str(tmp_path / "step_00000001")
    run_on_ranks(_export_worker, 2, args=(bases[family][1], step, tp, LoraConfig(rank=RANK, alpha=ALPHA, **settings)))
    proc = subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", step, str(tmp_path / "peft"),
                           "--peft-adapter"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr
    assert "lora.experts: the checkpoint has adapters on the MoE experts" in proc.stderr
    assert not (tmp_path / "peft").exists()


def _train_elsewhere(hf_dir: str, out_dir: str, r: int, alpha: float, modules: list[str]) -> None:
    """A PEFT adapter as peft makes one (random A and B: each projection its own A), saved by peft."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, PeftLoraConfig(r=r, lora_alpha=alpha, target_modules=modules))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out_dir)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_adapter_trained_with_peft_loads_with_peft_logits(bases, tmp_path, family):
    hf_dir, mg_dir = bases[family]
    peft_dir = str(tmp_path / "elsewhere")
    _train_elsewhere(hf_dir, peft_dir, 2, 6.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    _, want = _peft_logits(hf_dir, peft_dir)
    # separate A per projection: exact in disjoint rank slots at 3 x r with the same alpha / rank
    got = run_on_ranks(_import_worker, 2, args=(mg_dir, peft_dir, 2, LoraConfig(rank=6, alpha=18.0, targets=ALL)))[0]
    gap = float((got - want).abs().max() / want.abs().max())
    assert gap < 1e-5, gap
    # at r itself the fused linears cannot hold three different A; another scale or targets do not fit either
    for lora, key in ((LoraConfig(rank=2, alpha=6.0, targets=ALL), "lora.rank: 2: "),
                      (LoraConfig(rank=6, alpha=6.0, targets=ALL), "lora.alpha: "),
                      (LoraConfig(rank=6, alpha=18.0, targets=["linear_qkv"]), "lora.targets: ")):
        refused = run_on_ranks(_import_worker, 1, args=(mg_dir, peft_dir, 1, lora))[0]
        assert isinstance(refused, str) and refused.startswith(key), refused


def test_own_export_imports_back_at_the_same_rank(bases, tmp_path):
    """Our export (A copied to q/k/v and gate/up) loads back at rank r: the same logits."""
    from exgrpo_megatron.convert.megatron_to_hf import export_peft_adapter

    hf_dir, mg_dir = bases["qwen2"]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=ALL)
    step = str(tmp_path / "step_00000001")
    saved = run_on_ranks(_export_worker, 2, args=(mg_dir, step, 2, lora))[0]
    export_peft_adapter(step, str(tmp_path / "peft"), dtype="fp32")
    loaded = run_on_ranks(_import_worker, 1, args=(mg_dir, str(tmp_path / "peft"), 1, lora))[0]
    assert torch.equal(loaded, saved) or float((loaded - saved).abs().max()) < 1e-5
