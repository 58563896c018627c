"""A demo-model export (convert/megatron_to_hf.py, character tokenizer) carries eos/bos/pad ids,
generation_config.json and tokenizer files, so transformers' generate and vLLM both load it and stop at
<eos>. The model's weights are set so that greedy decoding emits <eos> first: without eos_token_id in the
export, generate would run to max_new_tokens."""

from __future__ import annotations

import json
import os

from tests.helpers.multirank import run_on_ranks

MAX_NEW = 12


def save_eos_model(ckpt: str) -> int:
    """A trainer-like step dir (model/ + model_config.yaml + config.yaml of a data.tokenizer=char run)."""
    import torch

    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_model_weights
    from exgrpo_megatron.config.loader import to_yaml
    from exgrpo_megatron.config.schema import DataConfig, ParallelConfig, RootConfig
    from exgrpo_megatron.data.tokenizer import CharTokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from tests.vllm.engines import tiny_model_config

    init_distributed(1, 1, seed=3)
    cfg = RootConfig(model=tiny_model_config(), data=DataConfig(tokenizer="char"))
    gpt = build_gpt_model(cfg.model, ParallelConfig())
    eos = CharTokenizer().eos_token_id
    with torch.no_grad():  # every position's final hidden state ~ +e_0; only <eos>'s output row reads e_0
        gpt.embedding.word_embeddings.weight[:, 0] += 4.0
        gpt.output_layer.weight[:, 0] = 0.0
        gpt.output_layer.weight[eos, 0] = 5.0
    save_model_weights(ckpt, [gpt], model_config_yaml=model_config_to_yaml(cfg.model))
    with open(os.path.join(ckpt, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    return eos


def vllm_generate(hf_dir: str, prompt_ids: list[int]) -> tuple[list[int], str]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=64,
              seed=0)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return list(out[0].outputs[0].token_ids), str(out[0].outputs[0].finish_reason)


def test_demo_export_loads_in_transformers_and_vllm_and_stops_at_eos(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    ckpt, out = str(tmp_path / "step"), str(tmp_path / "hf")
    eos = run_on_ranks(save_eos_model, world_size=1, args=(ckpt,))[0]
    convert_megatron_to_hf(ckpt, out, dtype="fp32", progress=False)  # the run's config.yaml says tokenizer=char

    config = json.load(open(os.path.join(out, "config.json")))
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (eos, 2, 0)
    assert generation["eos_token_id"] == eos
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.encode("12+3=", add_special_tokens=False)
    assert prompt == [8, 9, 71, 10, 75]  # the character tokenizer's ids

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):]
    assert generated.tolist() == [eos]  # stopped at <eos>, not at max_new_tokens

    tokens, finish = run_on_ranks(vllm_generate, world_size=1, args=(out, prompt))[0]
    assert tokens == [eos] and finish == "stop"
