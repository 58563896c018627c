"""What the converters refuse, and how: one stderr line naming the HF key (or the option), exit 2, no traceback —
architectures we do not implement (Mixtral, Qwen2-MoE's shared experts, dense layers in an MoE model, a sparse step),
a top-k above the expert count, a TP that does not divide the heads, and a sliding window wherever the HF config
enables one (the family table's keys, as transformers' own config classes read them). The export writes the window
switched off.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_convert_refusals.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exgrpo_megatron.config.families import FAMILIES, SlidingWindowKeys
from exgrpo_megatron.config.schema import ModelConfig
from exgrpo_megatron.convert.hf_config import hf_config_from_model_config, model_config_from_hf, windowed_layers
from tools.convert_hf_to_megatron import main as convert_main

QWEN3_MOE: dict[str, Any] = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, hidden_act="silu")
DENSE: dict[str, Any] = {k: v for k, v in QWEN3_MOE.items() if k not in (
    "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob")} | {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"]}

REFUSED = [  # (config.json, extra CLI arguments, the key the refusal must name)
    (dict(QWEN3_MOE, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8), [],
     "model_type"),
    (dict(QWEN3_MOE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=64),
     [], "model_type"),
    (dict(QWEN3_MOE, mlp_only_layers=[0]), [], "mlp_only_layers"),
    (dict(QWEN3_MOE, decoder_sparse_step=2), [], "decoder_sparse_step"),
    (dict(QWEN3_MOE, num_experts_per_tok=9), [], "num_experts_per_tok"),  # the old converter wrote top-k 9 of 8
    (dict(QWEN3_MOE, use_sliding_window=True, sliding_window=8, max_window_layers=2), [], "use_sliding_window"),
    (dict(DENSE, model_type="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1), [],
     "use_sliding_window"),
    (dict(DENSE, model_type="qwen2", layer_types=["full_attention", "sliding_attention"], sliding_window=8), [],
     "layer_types"),
    (dict(DENSE, num_local_experts=4), [], "num_local_experts"),
    (QWEN3_MOE, ["--tp", "3"], "--tp"),
]


@pytest.mark.parametrize(("hf", "args", "key"), REFUSED, ids=[r[2] + "-" + r[0]["model_type"] for r in REFUSED])
def test_the_converter_cli_refuses_with_exit_2_naming_the_key(tmp_path, capsys, hf, args, key):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    code = convert_main([str(tmp_path), str(tmp_path / "out"), "--no-progress", *args])  # old code: an exception
    err = capsys.readouterr().err
    assert code == 2
    assert f": {key}:" in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_converter_cli_exits_2_without_a_traceback_as_a_process(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_MOE, decoder_sparse_step=2)))
    proc = subprocess.run([sys.executable, "tools/convert_hf_to_megatron.py", str(tmp_path), str(tmp_path / "out")],
                          cwd=repo, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "decoder_sparse_step: 2" in proc.stderr


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize(("settings", "expected"), [
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), {"qwen2": [1, 2], "qwen3": [1, 2]}),
    (dict(use_sliding_window=True, sliding_window=8), {}),  # Qwen2/3: max_window_layers defaults to 28 > 3 layers
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), {"qwen2": [0, 1, 2], "qwen3": [0, 1, 2]}),
    (dict(use_sliding_window=True, sliding_window=None, max_window_layers=0), {}),
    (dict(use_sliding_window=False, sliding_window=8, max_window_layers=0), {}),
])
def test_windowed_layers_are_the_ones_transformers_windows(family, settings, expected):
    """The family's keys read as transformers' config class reads them: Qwen2/Qwen3 window the layers from
    max_window_layers on (layer_types), Qwen3-MoE every layer whenever use_sliding_window and a size are set."""
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    hf_cfg = cls(num_hidden_layers=3, **settings)
    if family == "qwen3_moe":
        theirs = [0, 1, 2] if hf_cfg.sliding_window is not None else []
    else:
        theirs = [i for i, t in enumerate(hf_cfg.layer_types) if t == "sliding_attention"]
    keys = FAMILIES[family].sliding_window
    assert keys is not None
    raw = {"num_hidden_layers": 3, **settings}  # config.json as a user may write it (no layer_types)
    assert windowed_layers(raw, keys)[1] == theirs == expected.get(family, [0, 1, 2] if family == "qwen3_moe"
                                                                    and settings["use_sliding_window"]
                                                                    and settings["sliding_window"] else [])
    assert windowed_layers(hf_cfg.to_dict(), keys)[1] == theirs  # as save_pretrained writes it


def test_a_family_whose_window_applies_by_default_refuses_a_config_that_leaves_the_key_out():
    """Mistral-style: no switch, a default size: the window applies when config.json does not mention it."""
    keys = SlidingWindowKeys(size="sliding_window", size_default=4096)
    assert windowed_layers({"num_hidden_layers": 2}, keys) == ("sliding_window", [0, 1])
    assert windowed_layers({"num_hidden_layers": 2, "sliding_window": None}, keys)[1] == []
    assert FAMILIES["llama"].sliding_window is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_the_export_writes_the_window_switched_off(family):
    moe = dict(num_experts=4, moe_ffn_hidden_size=32) if family == "qwen3_moe" else {}
    cfg = ModelConfig(name=family, family=family, num_layers=2, **moe)  # type: ignore[arg-type]
    base = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * 2}
    out = hf_config_from_model_config(cfg, base=base)
    assert out["use_sliding_window"] is False and out["sliding_window"] is None
    assert model_config_from_hf(out) == cfg  # and it converts back


def test_the_trainer_refuses_a_top_k_above_the_expert_count(capsys):
    from exgrpo_megatron.train import main

    assert main(["--config-name", "demo_moe_cpu", "--world-size", "2", "model.moe_router_topk=5"]) == 2
    assert "model.moe_router_topk: 5 experts per token but model.num_experts=4" in capsys.readouterr().err
