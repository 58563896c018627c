"""Convert math question/answer data into the parquet layout the trainer reads. Run once, offline
from training (the trainer never imports this file).

Output layout (one row per question; verl's column names, read through `data.prompt_key` and
`data.answer_key` dotted paths):

    data_source   string                        where the row came from (openr1, aime24, a file stem...)
    prompt        string                        the question text only; the trainer renders data.template
    reward_model  struct<ground_truth: string>  the reference answer (graded with Math-Verify)
    extra_info    struct<index: int64>          row number within the output file

Commands:

    # local jsonl / json / parquet files (pyarrow only; what the tests exercise)
    python tools/prepare_data.py local raw.jsonl more.parquet --output data/mine.parquet \
        --question-key problem --answer-key answer
    # OpenR1-Math-46k (Elliott/Openr1-Math-46k-8192; the R1 traces in `target` are dropped: the
    # trainer never uses them, docs/exgrpo.md)
    python tools/prepare_data.py openr1 --output data/openr1.parquet
    # the six in-distribution benchmarks and the three OOD multiple-choice ones (tables below)
    python tools/prepare_data.py benchmarks --output-dir data [--only arc_c,mmlu_pro]

The hub commands need the `datasets` package (not a dependency of this project: `pip install
datasets`) and network access; on an offline machine, download the files elsewhere and use `local`.
A question may be a string or a chat list (`[{"role": ..., "content": ...}, ...]`; the last user turn
is the question). An answer may be a string, a number or a list (joined with ", "); one pair of
enclosing `$` is stripped. Rows that cannot be converted are skipped and reported with their
location (`file:line` or `file:row`).

Benchmarks (public Hugging Face dataset ids; column names as documented on their cards; the
paper's avg@32 on AIME/AMC comes from `trainer.val_n`, not from duplicated rows):

| name          | dataset id                   | config            | split | question | answer       | rows |
|---------------|------------------------------|-------------------|-------|----------|--------------|------|
| aime24        | HuggingFaceH4/aime_2024      | -                 | train | problem  | answer       | 30   |
| aime25        | math-ai/aime25               | -                 | test  | problem  | answer       | 30   |
| amc           | AI-MO/aimo-validation-amc    | -                 | train | problem  | answer       | 83   |
| math500       | HuggingFaceH4/MATH-500       | -                 | test  | problem  | answer       | 500  |
| minerva       | math-ai/minervamath          | -                 | test  | question | answer       | 272  |
| olympiadbench | Hothan/OlympiadBench         | OE_TO_maths_en_COMP | train | question | final_answer | 675  |

Out-of-distribution multiple-choice benchmarks (the paper's OOD columns; the question text with its option
lines and the gold option label are built by `exgrpo_megatron.reward.multiple_choice`, the reference layout):

| name         | dataset id         | config        | split | fields used                                  | rows  |
|--------------|--------------------|---------------|-------|----------------------------------------------|-------|
| arc_c        | allenai/ai2_arc    | ARC-Challenge | test  | question, choices.{label,text}, answerKey    | 1172  |
| gpqa_diamond | Idavidrein/gpqa    | gpqa_diamond  | train | Question, Correct Answer, Incorrect Answer 1-3 | 198 |
| mmlu_pro     | TIGER-Lab/MMLU-Pro | -             | test  | question, options, answer                    | 12032 |

GPQA is gated on the hub (accept its terms, log in) and asks not to be redistributed: keep the converted
file private. `benchmarks` writes data/eval/<name>.parquet per benchmark, data/valid.parquet (the math
ones: the trainer's validation set) and data/valid_ood.parquet (the multiple-choice ones).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from exgrpo_megatron.reward import multiple_choice as mc

OUTPUT_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64())])),
])


@dataclass(frozen=True)
class HubSource:
    dataset_id: str
    split: str
    question_key: str
    answer_key: str
    config: str | None = None
    multiple_choice: str | None = None  # key of MC_ROWS: builds (question text with options, gold label)


def arc_row(row: Mapping[str, Any], index: int) -> tuple[str, str]:
    """ARC: the dataset's option labels (A-D, or 1-4) and answerKey."""
    choices = get_path(row, "choices")
    return mc.arc_question(get_path(row, "question"), list(choices["label"]), list(choices["text"])), \
        str(get_path(row, "answerKey")).strip()


def gpqa_row(row: Mapping[str, Any], index: int) -> tuple[str, str]:
    """GPQA: the correct answer shuffled among the three wrong ones, seeded by the row index (reproducible)."""
    wrong = [str(get_path(row, f"Incorrect Answer {i}")).strip() for i in (1, 2, 3)]
    options, gold = mc.shuffled_options(str(get_path(row, "Correct Answer")).strip(), wrong, seed=index)
    return mc.lettered_question(get_path(row, "Question"), options), gold


def mmlu_pro_row(row: Mapping[str, Any], index: int) -> tuple[str, str]:
    """MMLU-Pro: up to ten options, lettered A-J in the dataset's order; `answer` is the letter."""
    return mc.lettered_question(get_path(row, "question"), [str(o) for o in get_path(row, "options")]), \
        str(get_path(row, "answer")).strip()


MC_ROWS = {"arc": arc_row, "gpqa": gpqa_row, "mmlu_pro": mmlu_pro_row}


OPENR1 = HubSource("Elliott/Openr1-Math-46k-8192", "train", "prompt", "reward_model.ground_truth")
BENCHMARKS: dict[str, HubSource] = {
    "aime24": HubSource("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "aime25": HubSource("math-ai/aime25", "test", "problem", "answer"),
    "amc": HubSource("AI-MO/aimo-validation-amc", "train", "problem", "answer"),
    "math500": HubSource("HuggingFaceH4/MATH-500", "test", "problem", "answer"),
    "minerva": HubSource("math-ai/minervamath", "test", "question", "answer"),
    "olympiadbench": HubSource("Hothan/OlympiadBench", "train", "question", "final_answer", "OE_TO_maths_en_COMP"),
}
OOD_BENCHMARKS: dict[str, HubSource] = {
    "arc_c": HubSource("allenai/ai2_arc", "test", "question", "answerKey", "ARC-Challenge", multiple_choice="arc"),
    "gpqa_diamond": HubSource("Idavidrein/gpqa", "train", "Question", "Correct Answer", "gpqa_diamond",
                              multiple_choice="gpqa"),
    "mmlu_pro": HubSource("TIGER-Lab/MMLU-Pro", "test", "question", "answer", multiple_choice="mmlu_pro"),
}
ALL_BENCHMARKS = {**BENCHMARKS, **OOD_BENCHMARKS}


class HubUnavailable(RuntimeError):
    """The hub path cannot run here (no `datasets` package, offline, or the download failed)."""


@dataclass
class ConversionReport:
    kept: int = 0
    skipped: list[str] = field(default_factory=list)  # "location: reason"

    def summary(self, output: Path) -> str:
        lines = [f"wrote {self.kept} rows to {output}; skipped {len(self.skipped)} malformed row(s)"]
        lines += [f"  skipped {item}" for item in self.skipped]
        return "\n".join(lines)


def get_path(row: Mapping[str, Any], dotted_key: str) -> Any:
    """`row['a']['b']` for `dotted_key='a.b'`; KeyError naming the missing part."""
    value: Any = row
    for part in dotted_key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(f"missing key {dotted_key!r}")
        value = value[part]
    return value


def question_text(value: Any) -> str:
    """The question: a non-empty string, or the content of the last user turn of a chat list."""
    if isinstance(value, (list, tuple)):
        user_turns = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not user_turns:
            raise ValueError("chat-list question without a user turn")
        value = user_turns[-1].get("content")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"question is not a non-empty string ({type(value).__name__})")
    return value.strip()


def _scalar_answer(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer of type {type(value).__name__}")
    text = str(value).strip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$") and not text.startswith("$$"):
        text = text[1:-1].strip()
    return text


def answer_text(value: Any) -> str:
    """The reference answer as a string: scalars as text, lists joined with ', ', one `$...$` stripped."""
    if isinstance(value, (list, tuple)):
        text = ", ".join(_scalar_answer(v) for v in value)
    else:
        text = _scalar_answer(value)
    if not text:
        raise ValueError("empty answer")
    return text


def read_records(path: Path, fmt: str = "auto") -> Iterator[tuple[str, Mapping[str, Any] | Exception]]:
    """(location, row or the parse error) for each row of a jsonl / json / parquet file."""
    fmt = fmt if fmt != "auto" else {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}.get(
        path.suffix.lower(), "jsonl")
    if fmt == "parquet":
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    if fmt == "json":
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = data if isinstance(data, list) else [data]
        for i, row in enumerate(rows):
            yield f"{path}:row {i}", row if isinstance(row, Mapping) else ValueError("row is not an object")
        return
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path}:{line_no}", ValueError(f"invalid JSON ({exc.msg})")
                continue
            yield f"{path}:{line_no}", row if isinstance(row, Mapping) else ValueError("line is not a JSON object")


def convert_records(records: Iterable[tuple[str, Mapping[str, Any] | Exception]], question_key: str,
                    answer_key: str, data_source: str | None, default_source: str,
                    report: ConversionReport, rows: list[dict[str, Any]], multiple_choice: str | None = None) -> None:
    """Append converted rows to `rows` (index continues from len(rows)); record skipped ones in `report`.
    `data_source` None keeps a row's own string `data_source` column, else uses `default_source`.
    `multiple_choice` (a key of MC_ROWS) builds the question text and gold label from the option fields."""
    for i, (location, record) in enumerate(records):
        if isinstance(record, Exception):
            report.skipped.append(f"{location}: {record}")
            continue
        try:
            if multiple_choice:
                question, answer = MC_ROWS[multiple_choice](record, i)
                question, answer = question_text(question), answer_text(answer)
            else:
                question = question_text(get_path(record, question_key))
                answer = answer_text(get_path(record, answer_key))
        except (KeyError, ValueError, TypeError) as exc:
            report.skipped.append(f"{location}: {exc.args[0] if exc.args else exc}")
            continue
        source = data_source or (record.get("data_source") if isinstance(record.get("data_source"), str)
                                 else None) or default_source
        rows.append({"data_source": source, "prompt": question, "reward_model": {"ground_truth": answer},
                     "extra_info": {"index": len(rows)}})
        report.kept += 1


def write_parquet(rows: list[dict[str, Any]], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), tmp)
    tmp.replace(output)


def convert_local_files(paths: list[Path], output: Path, question_key: str = "prompt",
                        answer_key: str = "reward_model.ground_truth", data_source: str | None = None,
                        fmt: str = "auto") -> ConversionReport:
    """Convert local files into one parquet at `output`; malformed rows are skipped and reported."""
    report, rows = ConversionReport(), []
    for path in paths:
        convert_records(read_records(path, fmt), question_key, answer_key, data_source, path.stem, report, rows)
    if rows:
        write_parquet(rows, output)
    return report


def load_hub_rows(source: HubSource) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Rows of a hub dataset through `datasets` (imported here, only for the hub commands)."""
    try:
        import datasets
    except ImportError:
        raise HubUnavailable("downloading needs the `datasets` package (pip install datasets) and network "
                             "access; offline, fetch the files elsewhere and convert them with "
                             "`prepare_data.py local`") from None
    try:
        dataset = datasets.load_dataset(source.dataset_id, source.config, split=source.split)
    except Exception as exc:  # noqa: BLE001 - offline / not found / auth: all reported the same way
        raise HubUnavailable(f"cannot load {source.dataset_id} ({source.config or 'default'}, {source.split}) "
                             f"from the hub: {exc}. Offline, use `prepare_data.py local` on downloaded files") from None
    for i, row in enumerate(dataset):
        yield f"{source.dataset_id}:row {i}", row


def convert_hub(sources: dict[str, HubSource], output_for: dict[str, Path]) -> dict[str, ConversionReport]:
    reports = {}
    for name, source in sources.items():
        report, rows = ConversionReport(), []
        convert_records(load_hub_rows(source), source.question_key, source.answer_key, name, name, report, rows,
                        source.multiple_choice)
        if rows:
            write_parquet(rows, output_for[name])
        reports[name] = report
    return reports


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prepare_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="convert local jsonl/json/parquet files")
    local.add_argument("inputs", nargs="+", type=Path)
    local.add_argument("--output", type=Path, required=True)
    local.add_argument("--question-key", default="prompt", help="dotted path of the question (default: prompt)")
    local.add_argument("--answer-key", default="reward_model.ground_truth", help="dotted path of the answer")
    local.add_argument("--data-source", default=None, help="default: the row's data_source, else the file stem")
    local.add_argument("--format", default="auto", choices=("auto", "jsonl", "json", "parquet"))
    local.add_argument("--strict", action="store_true", help="exit 1 if any row was skipped")
    openr1 = sub.add_parser("openr1", help=f"download and convert {OPENR1.dataset_id}")
    openr1.add_argument("--output", type=Path, default=Path("data/openr1.parquet"))
    bench = sub.add_parser("benchmarks", help="download and convert the evaluation benchmarks")
    bench.add_argument("--output-dir", type=Path, default=Path("data"))
    bench.add_argument("--only", default=",".join(ALL_BENCHMARKS),
                       help="comma-separated subset of: " + ", ".join(ALL_BENCHMARKS))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "local":
        missing = [str(p) for p in args.inputs if not p.is_file()]
        if missing:
            print(f"prepare_data: no such file: {', '.join(missing)}", file=sys.stderr)
            return 1
        report = convert_local_files(args.inputs, args.output, args.question_key, args.answer_key,
                                     args.data_source, args.format)
        print(report.summary(args.output), file=sys.stderr)
        return 1 if report.kept == 0 or (args.strict and report.skipped) else 0
    try:
        if args.command == "openr1":
            reports = convert_hub({"openr1": OPENR1}, {"openr1": args.output})
            outputs = {"openr1": args.output}
        else:
            names = [n.strip() for n in args.only.split(",") if n.strip()]
            unknown = sorted(set(names) - set(ALL_BENCHMARKS))
            if unknown:
                print(f"prepare_data: unknown benchmark(s) {unknown}; known: {list(ALL_BENCHMARKS)}", file=sys.stderr)
                return 1
            outputs = {n: args.output_dir / "eval" / f"{n}.parquet" for n in names}
            reports = convert_hub({n: ALL_BENCHMARKS[n] for n in names}, outputs)
            for combined_name, group in (("valid.parquet", BENCHMARKS), ("valid_ood.parquet", OOD_BENCHMARKS)):
                combined = [p for n, p in outputs.items() if n in group and p.is_file()]
                if combined:
                    report = convert_local_files(combined, args.output_dir / combined_name)
                    print(report.summary(args.output_dir / combined_name), file=sys.stderr)
    except HubUnavailable as exc:
        print(f"prepare_data: {exc}", file=sys.stderr)
        return 1
    for name, report in reports.items():
        print(f"[{name}] {report.summary(outputs[name])}", file=sys.stderr)
    return 0 if all(r.kept for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
