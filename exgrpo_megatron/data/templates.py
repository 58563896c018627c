"""Prompt templates of the paper (docs/exgrpo.md) and the demo.

* ``own``: the LUFFY system instruction followed by ``User: This is the problem: {question}
  Assistant: <think>\\n`` (paper §G.1).
* ``chat``: the tokenizer's own chat template over ``[system: LUFFY instruction, user: question]``
  with the generation prompt (what the reference training run renders).
* ``llama_base``: ``User: {question} Answer: Let's think step by step.\\n`` (Llama-3.1-8B base).
* ``plain``: ``{question}\\n<think>\\n``, a short form for the synthetic CPU demo.
* ``chat_direct``: the tokenizer's chat template over ``[user: question]`` alone (the model's own default
  system turn), for small instruct models that answer directly (SmolLM2-135M-Instruct: 25% of the shipped
  word problems greedy with ~53 prompt tokens, 8% under the 181-token LUFFY instruction).

``own``, ``chat`` and ``plain`` expect the response to reason inside ``<think> … </think>`` and
answer after ``</think>``; ``llama_base`` and ``chat_direct`` do not (the whole response is graded).
"""

from __future__ import annotations

from exgrpo_megatron.config.schema import CHOICES
from exgrpo_megatron.data.tokenizer import Tokenizer

LUFFY_SYSTEM_PROMPT = (
    "Your task is to follow a systematic, thorough reasoning process before providing the final solution. "
    "This involves analyzing, summarizing, exploring, reassessing, and refining your thought process through "
    "multiple iterations. Structure your response into two sections: Thought and Solution. In the Thought "
    'section, present your reasoning using the format: "<think>\\n {thoughts} </think>\\n". Each thought should '
    "include detailed analysis, brainstorming, verification, and refinement of ideas. After \"</think>\\n,\" in "
    "the Solution section, provide the final, logical, and accurate answer, clearly derived from the exploration "
    "in the Thought section. If applicable, include the answer in \\boxed{} for closed-form results like "
    "multiple choices or mathematical solutions."
)

TEMPLATES: tuple[str, ...] = CHOICES["data.template"]


def _check_template(template: str) -> None:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; expected one of {TEMPLATES}")


def render_prompt(question: str, template: str, tokenizer: Tokenizer | None = None) -> str:
    """The prompt text for ``question`` under ``template`` (``chat`` needs a tokenizer with a chat template)."""
    _check_template(template)
    if template == "own":
        return f"{LUFFY_SYSTEM_PROMPT}\n\nUser: This is the problem: {question} Assistant: <think>\n"
    if template == "llama_base":
        return f"User: {question} Answer: Let's think step by step.\n"
    if template == "plain":
        return f"{question}\n<think>\n"
    if tokenizer is None:
        raise ValueError(f"the {template!r} template needs a tokenizer (its chat template renders the prompt)")
    messages = [{"role": "user", "content": question}]
    if template == "chat":
        messages.insert(0, {"role": "system", "content": LUFFY_SYSTEM_PROMPT})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
