"""Tokenizer files and special-token ids of an exported HF directory.

`save_char_tokenizer` writes the built-in character tokenizer (data/tokenizer.py, the demo's) as a
Hugging Face fast tokenizer with the same ids: its multi-character tokens are added tokens (matched
first, longest first), every other character is one WordLevel token, and decoding concatenates. So an
exported demo model loads in transformers and in vLLM with its tokenizer, and both stop at `<eos>`.

`special_token_ids` reads bos/eos/pad from a saved tokenizer, for config.json and generation_config.json
(transformers' `generate` and vLLM stop at `eos_token_id` from them).
"""

from __future__ import annotations

import os

from exgrpo_megatron.data.tokenizer import CHAR_MULTI_CHAR_TOKENS, CHAR_SPECIAL_TOKENS, CharTokenizer

RUN_TOKENIZER_CHAR = "char"


def save_char_tokenizer(out_dir: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    char = CharTokenizer()
    backend = Tokenizer(models.WordLevel(vocab=dict(char.token_to_id), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(CHAR_SPECIAL_TOKENS))
    backend.add_tokens(list(CHAR_MULTI_CHAR_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)


def special_token_ids(tokenizer_dir: str) -> dict[str, int]:
    """bos/eos/pad ids of the tokenizer saved in `tokenizer_dir` (those it defines)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return {k: int(v) for k, v in ids.items() if v is not None}


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
