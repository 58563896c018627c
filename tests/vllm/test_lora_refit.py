"""LoRA with rollout.engine=vllm: the refit streams each adapted linear's merged weight W + (B A) alpha/r.

Adapters with non-zero B (alpha/r = 2, all four targets) on the tiny fp32 Qwen2 policy, at TP=1, TP=2 and PP=2: vLLM's
greedy tokens after the refit equal the megatron engine's (which runs the adapters unmerged) and (TP=1, TP=2)
transformers + PEFT's, the PEFT model built with peft's own LoraConfig on the HF base and our adapter values copied in
by name (q/k/v share our linear_qkv's A, gate/up our linear_fc1's); vLLM's log-probs equal the policy's to 1e-4. A
trainer run with LoRA and vLLM, started from adapters with non-zero B (checkpoint.init_from), keeps the
rollout/trainer log-prob ratio at 1 at every step."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.multirank import run_on_ranks
from tests.vllm.engines import LOGPROB_TOL, NEW_TOKENS
from tests.vllm.test_trainer_vllm import TOL, _train

RANK, ALPHA = 4, 8.0
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_case(tp: int, pp: int, hf_dir: str) -> dict:
    from exgrpo_megatron.model.param_layout import named_global_params
    from exgrpo_megatron.rollout.refit import gather_tp_params
    from tests.vllm.engines import EnginePair, randomise_adapters_, tiny_model_config

    case = EnginePair(tp, pp, hf_dir, tiny_model_config(), lora_rank=RANK, lora_alpha=ALPHA)
    base_greedy = case.greedy(case.vllm)  # B = 0: the base model
    randomise_adapters_(case.policy.modules, seed=17)
    case.policy.mark_weights_changed()
    v_greedy, m_greedy = case.greedy(case.vllm), case.greedy(case.megatron)
    diffs, _ = case.sampled_logprob_diffs()
    named = named_global_params(case.policy.modules, tied_copy=False)
    full = dict(zip([n for n, _ in named], gather_tp_params([p for _, p in named]), strict=True))
    return {"prompts": case.prompts, "base_greedy": base_greedy, "vllm_greedy": v_greedy, "megatron_greedy": m_greedy,
            "max_logprob_diff": max(float(d.max()) for d in diffs),
            "params": {n: t.detach().clone() for n, t in full.items()}}


def peft_greedy(hf_dir: str, params: dict[str, torch.Tensor], prompts: list[list[int]]) -> list[list[int]]:
    """transformers + PEFT: the HF base from our base weights, peft's LoRA layers with our adapters copied in."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from exgrpo_megatron.convert.hf_mapping import megatron_to_hf
    from exgrpo_megatron.model.param_layout import is_adapter
    from tests.vllm.engines import hf_greedy, tiny_model_config

    cfg = tiny_model_config()
    base = {hf: t for name, p in params.items() if not is_adapter(name) for hf, t in megatron_to_hf(name, p, cfg)}
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    model.load_state_dict(base, strict=True)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS))
    peft_params = dict(model.named_parameters())
    copied = 0
    for name, p in params.items():
        if not name.endswith("lora_b"):
            continue
        stem = name.removesuffix("lora_b")
        # B is split like the weight (q/k/v rows, gate/up halves); A (the input side) is shared by those parts
        for hf_name, b in megatron_to_hf(stem + "weight", p, cfg):
            hf_stem = "base_model.model." + hf_name.removesuffix(".weight")
            with torch.no_grad():
                peft_params[f"{hf_stem}.lora_B.default.weight"].copy_(b)
                peft_params[f"{hf_stem}.lora_A.default.weight"].copy_(params[stem + "lora_a"])
            copied += 2
    assert copied == sum("lora_" in n for n in peft_params), "every PEFT adapter gets ours"
    return hf_greedy(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_vllm_lora_refit_equals_peft_and_megatron_engine(tp, pp, tiny_hf_dir):
    """At PP=2 each stage streams its own layers' merged weights; rank 0 holds the first stage's parameters only, so
    the PEFT reference (which needs them all) runs at TP=1 and TP=2."""
    results = run_on_ranks(lora_case, tp * pp, args=(tp, pp, tiny_hf_dir))
    r = results[0]
    print("lora refit:", {"max_logprob_diff": r["max_logprob_diff"], "vllm": r["vllm_greedy"][:2]})
    assert all(x["vllm_greedy"] == r["vllm_greedy"] for x in results)
    assert r["vllm_greedy"] != r["base_greedy"], "the adapters did not change vLLM's greedy output"
    assert r["vllm_greedy"] == r["megatron_greedy"]
    if pp == 1:
        assert r["vllm_greedy"] == peft_greedy(tiny_hf_dir, r["params"], r["prompts"])
    assert r["max_logprob_diff"] <= LOGPROB_TOL, r["max_logprob_diff"]


def test_trainer_with_vllm_and_lora_rolls_out_the_adapted_policy(tmp_path):
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train(run_dir, hf_dir, 3, extra=("--make-init", str(tmp_path / "init")),
           overrides=(f"lora.rank={RANK}", f"lora.alpha={ALPHA}"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ratios = {int(r["step"]): r["mismatch/token_mult_prob_error"] for r in rows}
    print("token_mult_prob_error per step (LoRA):", ratios)
    assert sorted(ratios) == [1, 2, 3]
    for step, ratio in ratios.items():
        assert abs(ratio - 1.0) <= TOL, f"step {step}: rollout/trainer log-prob ratio {ratio}"
