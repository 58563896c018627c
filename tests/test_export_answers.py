"""An exported demo model answers the same in transformers as in our engine.

A demo-shaped model (conf/model/demo_qwen2.yaml, the character tokenizer, seeded random weights) is saved as
a trainer saves it, greedy-decoded on demo arithmetic prompts by our megatron rollout engine, converted by
convert/megatron_to_hf.py and loaded the standard way (AutoTokenizer + AutoModelForCausalLM from the
directory): the prompts must encode to the character tokenizer's ids and the greedy answers must be the
engine's, token for token. `model_type: qwen2` makes AutoTokenizer rebuild a Qwen2Tokenizer from the
exported vocabulary whatever tokenizer_config.json names; the export must survive that (newlines and spaces
included)."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.multirank import run_on_ranks

MAX_NEW = 24
N_PROMPTS = 6


def demo_prompts() -> list[str]:
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.data.synthetic import make_arithmetic_dataset
    from exgrpo_megatron.data.templates import render_prompt

    data = load_config("demo_cpu").data
    triples = make_arithmetic_dataset(N_PROMPTS, seed=5, tiers=data.arithmetic_tiers)
    return [render_prompt(question, data.template) for question, _, _ in triples]


def save_and_decode(ckpt: str, prompts: list[list[int]]) -> list[list[int]]:
    """On a spawned rank: the demo model with seeded weights, saved as a trainer step dir (model/,
    model_config.yaml, config.yaml of a data.tokenizer=char run), and the engine's greedy answers."""
    import torch

    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_model_weights
    from exgrpo_megatron.config.loader import load_config, to_yaml
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.data.tokenizer import CharTokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    init_distributed(1, 1, seed=3)
    cfg = load_config("demo_cpu", ["model.params_dtype=fp32", "model.layer_spec=local"])
    gpt = build_gpt_model(cfg.model, ParallelConfig())
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # away from the near-uniform init, so greedy answers are decided by clear margins
        for p in gpt.parameters():
            p.add_(0.08 * torch.randn(p.shape, generator=g))
    save_model_weights(ckpt, [gpt], model_config_yaml=model_config_to_yaml(cfg.model))
    with open(os.path.join(ckpt, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    tok = CharTokenizer()
    engine = MegatronRolloutEngine(gpt, tok, vocab_size=cfg.model.vocab_size, max_batch_sequences=len(prompts))
    out = engine.generate(prompts, 1, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
    return [list(group[0].response_ids) for group in out]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf
    from exgrpo_megatron.data.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("export")
    ckpt, out = str(root / "step"), str(root / "hf")
    texts = demo_prompts()
    ids = [CharTokenizer().encode(t) for t in texts]
    answers = run_on_ranks(save_and_decode, world_size=1, args=(ckpt, ids))[0]
    convert_megatron_to_hf(ckpt, out, dtype="fp32", progress=False)  # its config.yaml says tokenizer=char
    return {"dir": out, "texts": texts, "ids": ids, "answers": answers}


def test_autotokenizer_encodes_and_decodes_as_the_character_tokenizer(exported) -> None:
    from transformers import AutoTokenizer

    from exgrpo_megatron.data.tokenizer import CharTokenizer

    assert json.load(open(os.path.join(exported["dir"], "config.json")))["model_type"] == "qwen2"
    tok = AutoTokenizer.from_pretrained(exported["dir"])
    for text, ids in zip(exported["texts"], exported["ids"], strict=True):
        assert text.endswith("\n<think>\n")
        assert tok.encode(text, add_special_tokens=False) == ids
        assert tok.decode(ids) == text
    for answer in exported["answers"]:
        assert tok.decode(answer) == CharTokenizer().decode(answer)


def test_transformers_greedy_answers_equal_the_engine_token_for_token(exported) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported["dir"])
    model = AutoModelForCausalLM.from_pretrained(exported["dir"], dtype=torch.float32).eval()
    for text, engine_answer in zip(exported["texts"], exported["answers"], strict=True):
        prompt = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)[0, prompt.shape[1]:].tolist()
        assert out == engine_answer, (text, tok.decode(out), tok.decode(engine_answer))
