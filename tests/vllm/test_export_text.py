"""vLLM's text path on an exported demo model: vLLM builds the tokenizer from the export (as AutoTokenizer
does, a Qwen2Tokenizer for `model_type: qwen2`), tokenizes the demo's prompts to the character tokenizer's
ids and answers greedily with our engine's tokens and text (tests/test_export_answers.py does the same
through transformers)."""

from __future__ import annotations

from tests.helpers.multirank import run_on_ranks
from tests.test_export_answers import MAX_NEW, demo_prompts, save_and_decode


def vllm_text_generate(hf_dir: str, texts: list[str]) -> list[tuple[list[int], list[int], str]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=64,
              seed=0)
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, skip_special_tokens=False))
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def test_vllm_text_prompts_tokenize_and_answer_as_the_engine(tmp_path) -> None:
    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf
    from exgrpo_megatron.data.tokenizer import CharTokenizer

    ckpt, out = str(tmp_path / "step"), str(tmp_path / "hf")
    texts, tok = demo_prompts(), CharTokenizer()
    ids = [tok.encode(t) for t in texts]
    answers = run_on_ranks(save_and_decode, world_size=1, args=(ckpt, ids))[0]
    convert_megatron_to_hf(ckpt, out, dtype="fp32", progress=False)

    results = run_on_ranks(vllm_text_generate, world_size=1, args=(out, texts))[0]
    for (prompt_ids, answer, text), expected_prompt, expected in zip(results, ids, answers, strict=True):
        assert prompt_ids == expected_prompt
        assert answer == expected
        assert text == tok.decode(expected)
