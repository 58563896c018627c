"""Prompt datasets: parquet / JSONL / JSON files in the verl (OpenR1-Math-46k) layout, rendered and tokenized once.

Layout (docs/exgrpo.md): one row per question; ``prompt`` is either the question string or a chat
list ``[{role, content}, ...]`` whose **last user turn** is the question (the LUFFY system turn is dropped:
the prompt template re-adds it); the gold answer sits at a dotted path into nested struct columns
(``reward_model.ground_truth``). An optional ``data_source`` column (e.g. ``aime24``) is kept per example.

Question ids: ``qid`` is the row's position across the concatenation of ``files`` in the given order
(0-based; for JSONL the line index, blank lines included). It is stable: filtering (too-long prompts) and
malformed rows leave gaps instead of renumbering, so a qid means the same question in every run over the
same files, on every rank, before and after a resume (the reference code also uses the row position as uid,
§1.1).

Rows are skipped, never fatal:
* malformed (missing field, wrong type, empty question/answer, JSON decode error, a JSONL line that is not
  valid UTF-8): ``logging.warning`` with file and row, and recorded in ``dataset.malformed`` as
  ``(file, row, reason)``;
* too long: the templated prompt has more than ``max_prompt_length`` tokens (counted in ``stats``).
A missing *column* (a parquet file without ``prompt_key``) is a configuration error and raises DataFileError, as
does a file that cannot be read at all; so does a data set left with no usable row (EmptyDatasetError, with the
count per reason).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from exgrpo_megatron.data.templates import render_prompt

logger = logging.getLogger(__name__)

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
DATA_SOURCE_KEY = "data_source"


class TextEncoder(Protocol):
    """Anything with ``encode(text) -> list[int]`` (every Tokenizer; ``chat`` also needs apply_chat_template)."""

    def encode(self, text: str) -> list[int]: ...


class MalformedRow(ValueError):
    """A row that cannot become a PromptExample; the message is the reason."""


class DataFileError(ValueError):
    """A whole data file cannot be read (a .json file with a byte that is not UTF-8, or broken JSON; a .parquet file
    that is empty, damaged or not parquet, or has no prompt / answer column); exit 2 at start-up naming it."""


class EmptyDatasetError(ValueError):
    """No row of the data files is usable; the message counts the rows per reason."""


@dataclass(frozen=True)
class PromptExample:
    qid: int
    question: str
    answer: str
    prompt_ids: list[int]
    data_source: str = ""


@dataclass
class DatasetStats:
    """Counts of one load: every row read is exactly one of kept / too_long / malformed."""

    num_rows: int = 0
    num_kept: int = 0
    num_too_long: int = 0
    num_malformed: int = 0
    max_prompt_tokens: int = 0  # over kept examples
    mean_prompt_tokens: float = 0.0  # over kept examples
    files: list[str] = field(default_factory=list)

    def as_metrics(self, prefix: str = "data") -> dict[str, float]:
        return {f"{prefix}/rows": float(self.num_rows), f"{prefix}/kept": float(self.num_kept),
                f"{prefix}/too_long": float(self.num_too_long), f"{prefix}/malformed": float(self.num_malformed),
                f"{prefix}/max_prompt_tokens": float(self.max_prompt_tokens),
                f"{prefix}/mean_prompt_tokens": float(self.mean_prompt_tokens)}


class PromptDataset:
    """Examples keyed by qid (gaps where rows were filtered). ``len`` = number of kept examples."""

    def __init__(self, examples: Sequence[PromptExample], stats: DatasetStats,
                 malformed: list[tuple[str, int, str]]) -> None:
        self._by_qid: dict[int, PromptExample] = {}
        for ex in examples:
            if ex.qid in self._by_qid:
                raise ValueError(f"duplicate qid {ex.qid}")
            self._by_qid[ex.qid] = ex
        self._qids = sorted(self._by_qid)
        self.stats = stats
        self.malformed = malformed

    def __len__(self) -> int:
        return len(self._qids)

    def __getitem__(self, qid: int) -> PromptExample:
        try:
            return self._by_qid[int(qid)]
        except KeyError:
            raise KeyError(f"qid {qid} is not in this dataset (filtered, malformed or out of range)") from None

    def __contains__(self, qid: object) -> bool:
        return qid in self._by_qid

    def __iter__(self) -> Iterator[PromptExample]:
        return (self._by_qid[q] for q in self._qids)

    def qids(self) -> list[int]:
        """Kept qids in increasing order."""
        return list(self._qids)


# ----------------------------------------------------------------------------------------- field extraction
def get_path(record: Any, path: str) -> Any:
    """``record[path]`` if that literal key exists, else follow the dotted path through nested dicts."""
    if isinstance(record, dict) and path in record:
        return record[path]
    node = record
    for i, part in enumerate(path.split(".")):
        if not isinstance(node, dict) or part not in node:
            where = ".".join(path.split(".")[:i + 1])
            raise MalformedRow(f"missing field {where!r}")
        node = node[part]
    return node


def extract_question(prompt: Any, prompt_key: str) -> str:
    """The question: ``prompt`` itself if a string, else the content of the last ``role == "user"`` turn."""
    if isinstance(prompt, str):
        question = prompt
    elif isinstance(prompt, (list, tuple)):
        user_turns = [turn for turn in prompt if isinstance(turn, dict) and turn.get("role") == "user"]
        if not user_turns:
            raise MalformedRow(f"{prompt_key!r} is a chat list without a user turn")
        content = user_turns[-1].get("content")
        if not isinstance(content, str):
            raise MalformedRow(f"{prompt_key!r}: last user turn has content of type {type(content).__name__}")
        question = content
    else:
        raise MalformedRow(f"{prompt_key!r} has type {type(prompt).__name__}; expected str or chat list")
    if not question.strip():
        raise MalformedRow(f"{prompt_key!r}: empty question")
    return question


def extract_answer(value: Any, answer_key: str) -> str:
    """Gold answer as a string; ints and finite floats are accepted and converted, anything else is malformed."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, tuple, dict)):
        raise MalformedRow(f"{answer_key!r} has type {type(value).__name__}; expected str")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedRow(f"{answer_key!r} is {value}")
        return repr(value)
    if not isinstance(value, str):
        raise MalformedRow(f"{answer_key!r} has type {type(value).__name__}; expected str")
    if not value.strip():
        raise MalformedRow(f"{answer_key!r}: empty answer")
    return value


# ----------------------------------------------------------------------------------------- file readers
# Each reader yields (row_index_in_file, record_or_MalformedRow).
RowIter = Iterator[tuple[int, "dict[str, Any] | MalformedRow"]]


def _top_level(key: str) -> str:
    return key.split(".")[0]


def _open_parquet(path: str) -> Any:
    """pyarrow's ParquetFile, or DataFileError naming the file when it is not one (0 bytes, truncated, garbage)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"{path}: not a readable parquet file ({os.path.getsize(path)} bytes): {exc}; re-export "
                            "or re-download it, or drop it from data.train_files / data.val_files") from None


def _read_parquet(path: str, columns: list[str]) -> RowIter:
    import pyarrow as pa

    pfile = _open_parquet(path)
    names = set(pfile.schema_arrow.names)
    wanted = []
    for col in columns:
        if col in names:
            wanted.append(col)
        elif _top_level(col) in names:
            wanted.append(_top_level(col))
        elif col != DATA_SOURCE_KEY:
            key = "data.prompt_key" if col == columns[0] else "data.answer_key"
            raise DataFileError(f"{path}: no column {col!r} ({key}); its columns: {sorted(names)}")
    row = 0
    try:
        for batch in pfile.iter_batches(columns=sorted(set(wanted)), batch_size=4096):
            for record in batch.to_pylist():
                yield row, record
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"{path}: damaged after row {row}: {exc}; re-export or re-download it") from None


def _read_jsonl(path: str) -> RowIter:
    with open(path, "rb") as fh:  # bytes: a line that is not UTF-8 is one malformed row, not a failed file
        for row, raw in enumerate(fh):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield row, MalformedRow(f"not valid UTF-8 (line {row + 1}, byte {exc.start}: "
                                        f"{raw[exc.start:exc.start + 4]!r})")
                continue
            if not line.strip():
                continue  # a blank line is a row index with no row
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield row, MalformedRow(f"JSON decode error (line {row + 1}): {exc.msg}")
                continue
            yield row, record if isinstance(record, dict) else MalformedRow(
                f"line {row + 1} is a JSON {type(record).__name__}, not an object")


def _read_json(path: str) -> RowIter:
    """A JSON list of row objects, or a column dict ``{column: [values...]}``."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}: not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 4]!r}); a .json "
                         "file is read whole, so one bad byte fails it (a .jsonl file skips the bad line)") from None
    except json.JSONDecodeError as exc:
        raise DataFileError(f"{path}: JSON decode error: {exc}") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise ValueError(f"{path}: column lists have different lengths {sorted(lengths)}")
        data = [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects or a dict of column lists")
    for row, record in enumerate(data):
        yield row, record if isinstance(record, dict) else MalformedRow(
            f"row is a JSON {type(record).__name__}, not an object")


def iter_rows(path: str, columns: list[str]) -> RowIter:
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return _read_parquet(path, columns)
    if lower.endswith(JSONL_SUFFIXES):
        return _read_jsonl(path)
    if lower.endswith(JSON_SUFFIXES):
        return _read_json(path)
    raise ValueError(f"{path}: unknown data file type; expected {PARQUET_SUFFIXES + JSONL_SUFFIXES + JSON_SUFFIXES}")


def count_rows(path: str) -> int:
    """Number of row indices a file occupies in the qid numbering (cheap for parquet)."""
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return int(_open_parquet(path).metadata.num_rows)
    if lower.endswith(JSONL_SUFFIXES):
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)
    return sum(1 for _ in _read_json(path))


# ----------------------------------------------------------------------------------------- building
def build_prompt_dataset(rows: Iterable[tuple[str, int, int, dict[str, Any] | MalformedRow]], *, prompt_key: str,
                         answer_key: str, tokenizer: TextEncoder, template: str,
                         max_prompt_length: int, files: Sequence[str] = ()) -> PromptDataset:
    """Turn ``(file, row, qid, record)`` tuples into a PromptDataset: extract, render, tokenize, filter, count."""
    stats = DatasetStats(files=list(files))
    malformed: list[tuple[str, int, str]] = []
    examples: list[PromptExample] = []
    total_tokens = 0
    for file, row, qid, record in rows:
        stats.num_rows += 1
        try:
            if isinstance(record, MalformedRow):
                raise record
            question = extract_question(get_path(record, prompt_key), prompt_key)
            answer = extract_answer(get_path(record, answer_key), answer_key)
            source = record.get(DATA_SOURCE_KEY, "")
            data_source = source if isinstance(source, str) else str(source)
        except MalformedRow as exc:
            stats.num_malformed += 1
            malformed.append((file, row, str(exc)))
            logger.warning("malformed row skipped: %s row %d: %s", file, row, exc)
            continue
        prompt_ids = list(tokenizer.encode(render_prompt(question, template, tokenizer)))  # type: ignore[arg-type]
        if len(prompt_ids) > max_prompt_length:
            stats.num_too_long += 1
            continue
        examples.append(PromptExample(qid, question, answer, prompt_ids, data_source))
        total_tokens += len(prompt_ids)
        stats.max_prompt_tokens = max(stats.max_prompt_tokens, len(prompt_ids))
    stats.num_kept = len(examples)
    stats.mean_prompt_tokens = total_tokens / len(examples) if examples else 0.0
    if stats.num_too_long or stats.num_malformed:
        logger.warning("prompt dataset %s: kept %d of %d rows (%d longer than %d tokens, %d malformed)",
                       list(files), stats.num_kept, stats.num_rows, stats.num_too_long, max_prompt_length,
                       stats.num_malformed)
    return PromptDataset(examples, stats, malformed)


def load_prompt_dataset(files: Sequence[str] | str, *, prompt_key: str = "prompt",
                        answer_key: str = "reward_model.ground_truth", tokenizer: TextEncoder, template: str,
                        max_prompt_length: int) -> PromptDataset:
    """Read ``files`` (parquet / JSONL / JSON) in order into one PromptDataset (qid = global row position)."""
    paths = [files] if isinstance(files, str) else list(files)
    if not paths:
        raise ValueError("load_prompt_dataset: no files given")
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt data file {path!r} does not exist")
    columns = [prompt_key, answer_key, DATA_SOURCE_KEY]

    def rows() -> Iterator[tuple[str, int, int, dict[str, Any] | MalformedRow]]:
        offset = 0
        for path in paths:
            for row, record in iter_rows(path, columns):
                yield path, row, offset + row, record
            offset += count_rows(path)

    dataset = build_prompt_dataset(rows(), prompt_key=prompt_key, answer_key=answer_key, tokenizer=tokenizer,
                                   template=template, max_prompt_length=max_prompt_length, files=paths)
    if not len(dataset):
        raise EmptyDatasetError(empty_dataset_message(dataset, max_prompt_length))
    return dataset


def reason_kind(reason: str) -> str:
    """A malformed-row reason without its row-specific parts (line numbers, decoder detail), for counting."""
    kind = re.sub(r"\s*\(line \d+[^)]*\)", "", reason)
    kind = re.sub(r"^line \d+ is", "row is", kind)
    return kind.split(": ")[0] if kind.startswith("JSON decode error") else kind


def empty_dataset_message(dataset: PromptDataset, max_prompt_length: int) -> str:
    s = dataset.stats
    counts = Counter(reason_kind(reason) for _file, _row, reason in dataset.malformed)
    lines = [f"{n} malformed: {kind}" for kind, n in counts.most_common()]
    if s.num_too_long:
        lines.append(f"{s.num_too_long} longer than data.max_prompt_length={max_prompt_length} tokens")
    return (f"no usable row in {s.files} ({s.num_rows} rows read):\n  " + "\n  ".join(lines or ["no rows at all"]))


def prompt_dataset_from_pairs(pairs: Sequence[tuple[str, str]] | Sequence[tuple[str, str, str]], *,
                              tokenizer: TextEncoder, template: str, max_prompt_length: int,
                              source: str = "<memory>") -> PromptDataset:
    """A PromptDataset from in-memory ``(question, answer[, data_source])`` tuples; qid = index."""
    def rows() -> Iterator[tuple[str, int, int, dict[str, Any]]]:
        for i, item in enumerate(pairs):
            record = {"prompt": item[0], "answer": item[1]}
            if len(item) > 2:
                record[DATA_SOURCE_KEY] = item[2]
            yield source, i, i, record

    return build_prompt_dataset(rows(), prompt_key="prompt", answer_key="answer", tokenizer=tokenizer,
                                template=template, max_prompt_length=max_prompt_length, files=[source])
