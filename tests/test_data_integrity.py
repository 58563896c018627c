"""Data rows that are not UTF-8 are malformed rows like any other (file + row reported, skipped, qids kept),
and a data set with no usable row fails at load with the count per reason."""

from __future__ import annotations

import json
import logging

import pytest

from exgrpo_megatron.data.datasets import EmptyDatasetError, load_prompt_dataset


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _line(question: str, answer: str = "1") -> bytes:
    return (json.dumps({"q": question, "a": answer}) + "\n").encode("utf-8")


def _load(*paths, max_prompt_length: int = 1000):
    return load_prompt_dataset([str(p) for p in paths], prompt_key="q", answer_key="a", tokenizer=ByteTokenizer(),
                               template="plain", max_prompt_length=max_prompt_length)


def test_non_utf8_line_is_reported_with_file_and_row_and_skipped(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    bad = b'{"q": "caf\xe9 latin-1", "a": "2"}\n'
    path.write_bytes(_line("zero") + bad + _line("two") + b"\xff\xfe\n" + _line("four"))
    second = tmp_path / "more.jsonl"
    second.write_bytes(_line("five"))
    with caplog.at_level(logging.WARNING):
        ds = _load(path, second)
    assert {q: ds[q].question for q in ds.qids()} == {0: "zero", 2: "two", 4: "four", 5: "five"}
    assert [(f, row) for f, row, _ in ds.malformed] == [(str(path), 1), (str(path), 3)]
    assert all("not valid UTF-8" in reason for _, _, reason in ds.malformed)
    assert ds.stats.num_malformed == 2 and ds.stats.num_rows == 6
    assert f"{path} row 1" in caplog.text and f"{path} row 3" in caplog.text


def test_data_set_without_usable_rows_fails_with_counts_per_reason(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\n" + b"\xfe\n" + b"{not json\n" + b"[1, 2]\n" + _line("") + _line("x" * 50)
                     + json.dumps({"q": "no answer"}).encode() + b"\n")
    with pytest.raises(EmptyDatasetError) as info:
        _load(path, max_prompt_length=20)
    message = str(info.value)
    assert str(path) in message and "7 rows read" in message
    assert "2 malformed: not valid UTF-8" in message
    assert "1 malformed: JSON decode error" in message
    assert "1 malformed: row is a JSON list, not an object" in message
    assert "1 malformed: 'q': empty question" in message
    assert "1 malformed: missing field 'a'" in message
    assert "1 longer than data.max_prompt_length=20 tokens" in message
