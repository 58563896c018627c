"""Tokenizer files and special-token ids of an exported HF directory.

`save_char_tokenizer` writes the built-in character tokenizer (data/tokenizer.py, the demo's) as a
Hugging Face fast tokenizer with the same ids. It is written as a byte-level BPE without merges (GPT-2's
byte-to-unicode table, the form of Qwen2's tokenizer): transformers' `AutoTokenizer` does not take the
class named in tokenizer_config.json for a `model_type: qwen2` export but rebuilds a `Qwen2Tokenizer` from
the vocabulary of tokenizer.json, whose byte-level pre-tokenizer turns "\\n" into "Ċ" and " " into "Ġ"; a
vocabulary keyed by the raw characters loses every newline and space there. Keyed by their byte-level
forms, `tokenizers.Tokenizer.from_file`, `PreTrainedTokenizerFast`, `Qwen2Tokenizer` (transformers and
vLLM) all give the character tokenizer's ids. The multi-character tokens (`<think>`, `</think>`, `\\boxed{`
and the special tokens) are added tokens, matched first. Characters outside the vocabulary, which the
character tokenizer maps to `<unk>`, are the one difference: the byte-level path has no `<unk>` for them.

`check_tokenizer_export` loads an exported directory the way users do (`AutoTokenizer`, config.json
present) and compares its ids with tokenizer.json's own, so an export whose tokenizer would load as another
class with other ids fails at conversion instead of answering wrongly. `special_token_ids` reads
bos/eos/pad for config.json and generation_config.json (transformers' `generate` and vLLM stop at
`eos_token_id` from them).
"""

from __future__ import annotations

import os

from exgrpo_megatron.data.tokenizer import CHAR_MULTI_CHAR_TOKENS, CHAR_SPECIAL_TOKENS, CharTokenizer

RUN_TOKENIZER_CHAR = "char"
TOKENIZER_JSON = "tokenizer.json"
# Text that every exported tokenizer must encode as tokenizer.json does: newlines, runs of spaces, the
# demo's tags and arithmetic (the characters of the character tokenizer only).
PROBE_TEXT = "3+4=?\n<think>\n 12 * (5-3) =  24 </think>\n\\boxed{24}\n\nUser: Why? Answer: x_1^2 < y/2.\n"


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 src/encoder.py `bytes_to_unicode`): printable
    Latin-1 bytes map to themselves, the other 68 to chr(256 + k) in byte order ("\\n" -> "Ċ", " " -> "Ġ")."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_char_tokenizer(out_dir: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    char = CharTokenizer()
    alphabet = byte_level_alphabet()
    multi = {*CHAR_SPECIAL_TOKENS, *CHAR_MULTI_CHAR_TOKENS}
    vocab = {tok if tok in multi else "".join(alphabet[b] for b in tok.encode()): i
             for tok, i in char.token_to_id.items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(CHAR_SPECIAL_TOKENS))
    backend.add_tokens(list(CHAR_MULTI_CHAR_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)


def check_tokenizer_export(out_dir: str) -> None:
    """ValueError unless `AutoTokenizer` on `out_dir` (config.json written) encodes and decodes PROBE_TEXT as
    its tokenizer.json does. Directories without tokenizer.json are not checked."""
    path = os.path.join(out_dir, TOKENIZER_JSON)
    if not os.path.isfile(path):
        return
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    expected = Tokenizer.from_file(path).encode(PROBE_TEXT, add_special_tokens=False).ids
    auto = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    ids = list(auto.encode(PROBE_TEXT, add_special_tokens=False))
    if ids != expected:
        raise ValueError(f"{out_dir}: AutoTokenizer builds a {type(auto).__name__} for this export that encodes "
                         f"{PROBE_TEXT!r} as {ids}, not as its tokenizer.json does ({expected})")
    decoded = auto.decode(ids)
    if decoded != PROBE_TEXT:
        raise ValueError(f"{out_dir}: AutoTokenizer ({type(auto).__name__}) decodes {PROBE_TEXT!r} as {decoded!r}")


def special_token_ids(tokenizer_dir: str) -> dict[str, int]:
    """bos/eos/pad ids of the tokenizer saved in `tokenizer_dir` (those it defines)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return {k: int(v) for k, v in ids.items() if v is not None}


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
