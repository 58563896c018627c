"""Benchmark evaluation with the paper's protocol (docs/exgrpo.md).

    python -m exgrpo_megatron.evaluate --model PATH --data FILE [FILE ...] [--out DIR] ...

Protocol: sampling at temperature 0.6, top-p 1.0, up to 8192 new tokens; avg@k for AIME24, AIME25 and AMC
(k = 32) and pass@1 for the other benchmarks, chosen per ``data_source`` (``--avg-k``). Rows that are
identical in (data_source, question, gold) are ONE question (the reference test parquet repeats AIME/AMC
rows 32 times so that n=1 sampling gives avg@32; here such a question gets k samples once).

Benchmarks: the six in-distribution math ones and the paper's out-of-distribution multiple-choice ones
(``arc_c``, ``gpqa_diamond``, ``mmlu_pro``: ``reward.multiple_choice``), told apart by ``data_source``; the
table lists math first, then OOD, then the paper's averages (avg ID, avg OOD, avg all).

Grading of every generation (``reward.benchmark_grading``, in worker processes, each response as soon as the
engine batch that finishes it is done): the boxed grader (``reward.boxed``, the label that counts, as the
reference's OAT grader; for a multiple-choice row the boxed option letter) and Math-Verify as a second opinion;
both are recorded, disagreements counted. When the rendered prompt ends with ``<think>\\n`` (templates ``own``
and ``plain``; ``chat`` only if the tokenizer's template adds it) a response without ``</think>`` is wrong
under both, and only the text after ``</think>`` is graded (the reference rule).

Metric per benchmark (k samples for each of its Q questions, c_qj = 1 if sample j of question q is correct):
    avg@k = (1/Q) * sum_q (1/k) * sum_j c_qj        (pass@1 is the same with k = 1)

Generation goes through the rollout service (``rollout_service.py``: wake, generate, sleep, refit timing;
training and validation generate through it too) over a ``RolloutEngine`` (megatron-core engine; vLLM on GPU),
with the benchmark grading as its grading sink (``BenchmarkSink``). The model is a Hugging
Face directory (converted once to a temporary megatron checkpoint) or one of our checkpoints (run dir,
``checkpoints/`` dir or ``step_X/`` dir with ``model/`` + ``model_config.yaml``). Nothing is downloaded.
Outputs: ``<out>/generations.jsonl`` (one line per generation) and ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from exgrpo_megatron.config.schema import CHOICES
from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.data.tokenizer import Tokenizer
from exgrpo_megatron.reward.benchmark_grading import (  # noqa: F401  (combine_labels, grade_generation: re-exported)
    BenchmarkGrading,
    BenchmarkSink,
    Question,
    combine_labels,
    grade_generation,
)
from exgrpo_megatron.reward.multiple_choice import is_multiple_choice
from exgrpo_megatron.rollout.types import RolloutEngine, SamplingParams
from exgrpo_megatron.training.rollout_service import Generated, RolloutService

DEFAULT_AVG_K: dict[str, int] = {"aime24": 32, "aime25": 32, "amc": 32}


# ----------------------------------------------------------------------------------------- pure parts
def parse_avg_k(spec: str) -> dict[str, int]:
    """``"aime24=32,amc=16"`` -> ``{"aime24": 32, "amc": 16}`` (names lower-cased; empty spec -> {})."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--avg-k: expected NAME=K with K >= 1, got {item!r}")
        out[name.strip().lower()] = int(value)
    return out


def samples_per_question(data_source: str, avg_k: dict[str, int]) -> int:
    """k for a benchmark: its ``avg_k`` entry (case-insensitive), else 1 (pass@1)."""
    return avg_k.get(data_source.lower(), 1)


def metric_name(k: int) -> str:
    return "pass@1" if k == 1 else f"avg@{k}"


def aggregate(records: Sequence[dict]) -> dict[str, dict]:
    """Per-benchmark metrics from generation records (keys ``data_source``, ``question_index``, ``correct``,
    ``math_verify_correct``, ``boxed_correct``, ``disagree``; optional ``finish_reason``): see module docstring."""
    by_source: dict[str, dict[int, list[dict]]] = {}
    for rec in records:
        by_source.setdefault(rec["data_source"], {}).setdefault(rec["question_index"], []).append(rec)
    table: dict[str, dict] = {}
    for source in sorted(by_source, key=lambda s: (is_multiple_choice(s), s)):  # math (ID) first, then OOD
        questions = list(by_source[source].values())
        ks = sorted({len(q) for q in questions})

        def mean_of_means(key: str, qs: list[list[dict]] = questions) -> float:
            return sum(sum(bool(r[key]) for r in q) / len(q) for q in qs) / len(qs)

        gens = [r for q in questions for r in q]
        table[source] = {
            "metric": metric_name(ks[0]) if len(ks) == 1 else f"avg@{ks[0]}-{ks[-1]}",
            "accuracy": mean_of_means("correct"),
            "boxed_accuracy": mean_of_means("boxed_correct"),
            "math_verify_accuracy": mean_of_means("math_verify_correct"),
            "questions": len(questions),
            "generations": len(gens),
            "disagreements": sum(bool(r["disagree"]) for r in gens),
            "truncated": sum(r.get("finish_reason") == "length" for r in gens),
        }
    return table


def format_table(table: dict[str, dict]) -> str:
    lines = [f"{'benchmark':16s} {'metric':>8s} {'acc %':>7s} {'boxed %':>8s} {'MathVer %':>9s} {'Q':>5s} "
             f"{'gens':>6s} {'disagree':>8s} {'trunc':>6s}"]
    for source, row in table.items():
        lines.append(f"{source or '<none>':16s} {row['metric']:>8s} {100 * row['accuracy']:7.2f} "
                     f"{100 * row['boxed_accuracy']:8.2f} {100 * row['math_verify_accuracy']:9.2f} "
                     f"{row['questions']:5d} {row['generations']:6d} {row['disagreements']:8d} {row['truncated']:6d}")
    for name, value in averages(table).items():
        lines.append(f"{name:16s} {'':>8s} {100 * value:7.2f}")
    return "\n".join(lines)


def averages(table: dict[str, dict]) -> dict[str, float]:
    """The paper's summary columns: the mean accuracy over the in-distribution (math) benchmarks, over the
    out-of-distribution (multiple-choice) ones, and over all; each only when it has a benchmark."""
    groups = {"avg ID (math)": [r["accuracy"] for s, r in table.items() if not is_multiple_choice(s)],
              "avg OOD": [r["accuracy"] for s, r in table.items() if is_multiple_choice(s)],
              "avg all": [r["accuracy"] for r in table.values()]}
    return {name: sum(accs) / len(accs) for name, accs in groups.items() if accs}


# ----------------------------------------------------------------------------------------- pipeline
@dataclass(frozen=True)
class EvalSettings:
    template: str = "own"
    temperature: float = 0.6
    top_p: float = 1.0
    max_new_tokens: int = 8192
    avg_k: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_AVG_K))
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    grade_timeout_seconds: int = 5
    grade_workers: int = 2
    prompts_per_call: int = 64


def group_questions(examples) -> list[Question]:
    """Unique questions from PromptExamples, in first-appearance order (duplicate rows merged)."""
    index: dict[tuple[str, str, str], Question] = {}
    for ex in examples:
        key = (ex.data_source, ex.question, ex.answer)
        if key not in index:
            index[key] = Question(len(index), ex.data_source, ex.question, ex.answer, list(ex.prompt_ids))
        index[key].qids.append(ex.qid)
    return list(index.values())


def evaluate_questions(questions: Sequence[Question], rollout: RolloutService, tokenizer: Tokenizer,
                       settings: EvalSettings, jsonl_path: str | None = None,
                       grading: BenchmarkGrading | None = None) -> list[dict]:
    """Generate k samples per question (k by its data_source) through the rollout service, grade them, append
    records to ``jsonl_path``.

    Sample j of question q uses request seed q.index, so results do not depend on the batching. The engine stays
    awake for all calls of ``EvalSettings.prompts_per_call`` questions; each call's responses go to ``grading`` (a
    ``BenchmarkSink``) as its engine batches finish and are graded while the next call generates; a call's records
    are written when the next call has returned (the last ones at the end), in generation order. With
    ``grading=None`` (non-zero ranks of a TP group) only the generation runs."""
    records: list[dict] = []
    sink = open(jsonl_path, "w", encoding="utf-8") if jsonl_path else None

    def finish(call: Generated[BenchmarkSink] | None) -> None:
        for rec in call.grading.result() if call else []:
            records.append(rec)
            if sink:
                sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
        if sink:
            sink.flush()

    try:
        by_k: dict[int, list[Question]] = {}
        for q in questions:
            by_k.setdefault(samples_per_question(q.data_source, settings.avg_k), []).append(q)
        params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                top_p=settings.top_p, stop_token_ids=list(settings.stop_token_ids), seed=settings.seed)
        pending: Generated[BenchmarkSink] | None = None  # the previous call: records waiting for their verdicts
        with rollout.awake():
            for k, group in sorted(by_k.items()):
                for start in range(0, len(group), settings.prompts_per_call):
                    block = group[start:start + settings.prompts_per_call]
                    groups = [QuestionGroup(q.index, q.prompt_ids, q.gold) for q in block]  # request seed: q.index
                    call = rollout.generate_into(groups, k, params, BenchmarkSink(grading, tokenizer, block))
                    finish(pending)  # the previous call's verdicts, graded while this call generated
                    pending = call
        finish(pending)
    finally:
        if sink:
            sink.close()
    return records


# ----------------------------------------------------------------------------------------- models, CLI
def load_eval_tokenizer(kind: str, tokenizer_dir: str | None):
    from exgrpo_megatron.data.tokenizer import load_tokenizer

    if kind == "hf" and not tokenizer_dir:
        raise ValueError("no tokenizer directory: pass --tokenizer-dir (the checkpoint's model_config has no hf_path)")
    if kind == "hf" and not os.path.isdir(tokenizer_dir):  # type: ignore[arg-type]
        raise FileNotFoundError(f"--tokenizer-dir {tokenizer_dir!r} does not exist")
    return load_tokenizer(kind, tokenizer_dir)


def generation_stop_ids(hf_dir: str | None, eos_token_id: int | None) -> list[int]:
    """Extra stop ids from ``generation_config.json`` (its ``eos_token_id``, int or list), as vLLM uses them."""
    path = os.path.join(hf_dir, "generation_config.json") if hf_dir else ""
    if not path or not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        eos = json.load(fh).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return [int(i) for i in ids if i != eos_token_id]


def resolve_model_path(path: str) -> tuple[str, str]:
    """("hf", dir) for a directory with config.json + weights, else ("megatron", step dir)."""
    from exgrpo_megatron.checkpoint.layout import newest_if_run_dir
    from exgrpo_megatron.convert.megatron_to_hf import resolve_checkpoint

    if not os.path.exists(path):
        raise FileNotFoundError(f"--model {path!r} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    path = newest_if_run_dir(path)
    model_dir, _ = resolve_checkpoint(path)
    if os.path.basename(os.path.normpath(model_dir)) != "model":
        raise FileNotFoundError(f"{path}: expected a step dir with model/ and model_config.yaml")
    return "megatron", os.path.dirname(os.path.normpath(model_dir))


def single_process_env() -> dict[str, str]:
    """torch.distributed env for a one-process run on a free local port (parallel runs do not collide)."""
    from exgrpo_megatron.distributed.launch_env import free_local_port

    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_local_port())}


def load_policy(model_path: str, tp: int, work_dir: str):
    """(GPTModel, ModelConfig, hf_dir or None) on this rank. An HF model is first converted (rank 0) into
    ``<work_dir>/converted_checkpoint`` (reused when present); our checkpoints load directly."""
    import torch
    import torch.distributed as dist

    from exgrpo_megatron.checkpoint import load_model_weights
    from exgrpo_megatron.config.derived import resolve_params_dtype
    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.convert.hf_config import load_model_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    kind, path = resolve_model_path(model_path)
    init_distributed(tp, 1)
    hf_dir = None
    if kind == "hf":
        from exgrpo_megatron.config.schema import ModelConfig
        from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

        hf_dir, ckpt = path, os.path.join(work_dir, "converted_checkpoint")
        if dist.get_rank() == 0 and not os.path.isfile(os.path.join(ckpt, "model_config.yaml")):
            dtype = "bf16" if resolve_params_dtype(ModelConfig(params_dtype="auto")) == torch.bfloat16 else "fp32"
            convert_hf_to_megatron(hf_dir, ckpt, tp_size=tp, dtype=dtype, progress=False)
        dist.barrier()
        path = ckpt
    cfg = load_model_config(os.path.join(path, "model_config.yaml"))
    hf_dir = hf_dir or cfg.hf_path
    model = build_gpt_model(cfg, ParallelConfig(tensor_model_parallel_size=tp))
    load_model_weights(path, [model])
    return model.eval(), cfg, hf_dir


def vllm_settings(overrides: Sequence[str]):
    """`rollout.vllm` as conf/rollout/megatron.yaml documents it, with `KEY=VALUE` overrides (--vllm)."""
    from omegaconf import OmegaConf

    from exgrpo_megatron.config.loader import CONF_DIR
    from exgrpo_megatron.config.schema import VllmConfig

    conf = OmegaConf.load(CONF_DIR / "rollout" / "megatron.yaml").vllm
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VllmConfig), conf,
                                               OmegaConf.from_dotlist(list(overrides))))


def build_engine(kind: str, model, cfg, tokenizer, hf_dir: str | None, args: argparse.Namespace) -> RolloutEngine:
    from exgrpo_megatron.rollout.factory import build_rollout_engine

    # Sample only ids the tokenizer can decode (a model's vocabulary may be larger than its tokenizer's).
    vocab = min(cfg.vocab_size, getattr(tokenizer, "vocab_size", cfg.vocab_size))
    return build_rollout_engine(kind, model, cfg, tokenizer, vllm=vllm_settings(args.vllm), hf_dir=hf_dir,
                                seed=args.seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                                max_batch_sequences=args.max_batch_sequences, vocab_size=vocab)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m exgrpo_megatron.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model dir, or our run / checkpoints / step_X dir")
    p.add_argument("--data", required=True, nargs="+",
                   help="parquet/JSONL/JSON files (prompt, reward_model.ground_truth, data_source)")
    p.add_argument("--tokenizer", choices=CHOICES["data.tokenizer"], default="hf")
    p.add_argument("--tokenizer-dir", default=None, help="default: the HF model dir / the checkpoint's model.hf_path")
    p.add_argument("--template", choices=CHOICES["data.template"], default="own")
    p.add_argument("--engine", choices=CHOICES["rollout.engine"], default="megatron")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--max-prompt-length", type=int, default=4096, help="longer prompts are skipped (counted)")
    p.add_argument("--avg-k", default=",".join(f"{k}={v}" for k, v in DEFAULT_AVG_K.items()),
                   help="NAME=K,... samples per question by data_source; others pass@1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (launch with torchrun for > 1)")
    p.add_argument("--max-batch-sequences", type=int, default=64)
    p.add_argument("--vllm", nargs="*", default=[], metavar="KEY=VALUE",
                   help="vLLM engine settings over conf/rollout's rollout.vllm (e.g. enforce_eager=true)")
    p.add_argument("--prompts-per-call", type=int, default=64)
    p.add_argument("--grade-timeout", type=int, default=5)
    p.add_argument("--grade-workers", type=int, default=2, help="grading processes (grade while generating)")
    p.add_argument("--out", default="eval_results")
    p.add_argument("--keep-converted", action="store_true", help="keep <out>/converted_checkpoint of an HF model")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    for f in args.data:
        if not os.path.isfile(f):
            raise SystemExit(f"error: --data file {f!r} does not exist")
    if not os.path.exists(args.model):
        raise SystemExit(f"error: --model {args.model!r} does not exist")
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(single_process_env())
    from exgrpo_megatron.distributed import cpu_shims

    cpu_shims.apply()  # before megatron-core is imported: its known CPU warnings are filtered (no-op on GPU)
    import torch.distributed as dist

    from exgrpo_megatron.data.datasets import load_prompt_dataset

    settings = EvalSettings(template=args.template, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, avg_k=parse_avg_k(args.avg_k), seed=args.seed,
                            grade_timeout_seconds=args.grade_timeout, grade_workers=args.grade_workers,
                            prompts_per_call=args.prompts_per_call)
    os.makedirs(args.out, exist_ok=True)
    model, cfg, hf_dir = load_policy(args.model, args.tp, args.out)
    tokenizer = load_eval_tokenizer(args.tokenizer, args.tokenizer_dir or hf_dir)
    settings = dataclasses.replace(settings, stop_token_ids=generation_stop_ids(hf_dir, tokenizer.eos_token_id))
    dataset = load_prompt_dataset(args.data, tokenizer=tokenizer, template=args.template,
                                  max_prompt_length=args.max_prompt_length)
    questions = group_questions(dataset)
    engine = build_engine(args.engine, model, cfg, tokenizer, hf_dir, args)
    is_writer = dist.get_rank() == 0
    start = time.perf_counter()
    with BenchmarkGrading(settings.grade_workers, settings.grade_timeout_seconds) if is_writer \
            else contextlib.nullcontext() as grading:
        records = evaluate_questions(questions, RolloutService(engine), tokenizer, settings,
                                     os.path.join(args.out, "generations.jsonl") if is_writer else None, grading)
    table = aggregate(records)
    converted = os.path.join(args.out, "converted_checkpoint")
    if is_writer and not args.keep_converted and os.path.isdir(converted):
        shutil.rmtree(converted)
    if is_writer:
        print(format_table(table))
        summary = {"command": " ".join(["python -m exgrpo_megatron.evaluate", *(argv or sys.argv[1:])]),
                   "settings": dataclasses.asdict(settings), "data": args.data, "model": args.model,
                   "dataset_stats": dataclasses.asdict(dataset.stats), "seconds": time.perf_counter() - start,
                   "benchmarks": table, "averages": averages(table)}
        with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        print(f"wrote {args.out}/generations.jsonl and {args.out}/summary.json")
    return table


if __name__ == "__main__":
    main()
