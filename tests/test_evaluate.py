"""Benchmark evaluation: boxed extraction and grading, avg@k aggregation, the pipeline on a local fixture
(scripted engine: what is under test is grading + aggregation), and one real end-to-end run of the CLI on
a tiny random megatron checkpoint through the real MegatronRolloutEngine."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from exgrpo_megatron.data.datasets import load_prompt_dataset
from exgrpo_megatron.data.templates import render_prompt
from exgrpo_megatron.data.tokenizer import CharTokenizer
from exgrpo_megatron.evaluate import (
    EvalSettings,
    aggregate,
    combine_labels,
    evaluate_questions,
    group_questions,
    main,
    parse_avg_k,
    samples_per_question,
)
from exgrpo_megatron.reward.benchmark_grading import BenchmarkGrading
from exgrpo_megatron.reward.boxed import grade_boxed, last_boxed_content, normalize_answer
from exgrpo_megatron.rollout.types import Sample, SamplingParams
from exgrpo_megatron.training.rollout_service import RolloutService
from tests.helpers.multirank import run_on_ranks

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "eval_small.jsonl")


# ----------------------------------------------------------------------------------------- boxed extraction
@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),  # nested braces
    (r"\boxed{a{b}c} and later \boxed{d}", "d"),  # several boxes: the last
    (r"\boxed{\frac{a}{\boxed{b}}}", "b"),  # a box inside a box: the last one opened
    ("no box here, the answer is 5", None),
    (r"\boxed{unbalanced", None),
    (r"\fbox{7}", "7"),
    (r"\boxed 12 is it", "12"),
])
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


@pytest.mark.parametrize("raw, expected", [
    (r"\dfrac{1}{2}", r"\frac{1}{2}"), (r"\left( 1, 2 \right)", "(1,2)"), ("90^\\circ", "90"), ("90^{\\circ}", "90"),
    (r"10\text{ cm}", "10"), (r"\text{(B)}", "B"), ("5.", "5"), ("x = 7", "7"), ("1,000", "1000"),
    (r"\frac12", r"\frac{1}{2}"), (r"50\%", "50"), ("$3$", "3"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


GRADING_TABLE = [  # (response, gold, require_think, expected boxed verdict)
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", False, True),
    (r"\boxed{0.5}", r"\frac{1}{2}", False, True),  # numeric equality (Math-Verify)
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", False, True),  # symbolic equality
    (r"\boxed{x^2+2x+1}", "(x+1)^2", False, True),
    (r"\boxed{90^\circ}", "90", False, True),
    (r"\boxed{10\text{ cm}}", "10", False, True),
    (r"\boxed{\left(1,2\right)}", "(1,2)", False, True),
    (r"\boxed{\text{(C)}}", "C", False, True),
    (r"\boxed{4} then \boxed{5}", "5", False, True),
    (r"\boxed{5} then \boxed{4}", "5", False, False),
    (r"\boxed{3}.", "4", False, False),
    (r"\boxed{1/3}", "0.33", False, False),
    ("The answer is 5", "5", False, False),  # no box: wrong for the boxed grader
    (r"thinking </think> \boxed{5}", "5", True, True),
    (r"thinking without the closing tag \boxed{5}", "5", True, False),  # missing </think>
    (r"\boxed{5} </think> final \boxed{6}", "5", True, False),  # only after </think> counts
]


@pytest.mark.parametrize("response, gold, require_think, expected", GRADING_TABLE)
def test_boxed_grading_table(response, gold, require_think, expected):
    assert grade_boxed(response, gold, require_think).correct is expected


def test_label_combination():
    assert combine_labels(True, True) == (True, False)
    assert combine_labels(True, False) == (True, True)
    assert combine_labels(False, True) == (False, True)
    assert combine_labels(False, False) == (False, False)


# ----------------------------------------------------------------------------------------- aggregation
def test_avg_k_parsing():
    assert parse_avg_k("AIME24=32, amc=4") == {"aime24": 32, "amc": 4}
    assert parse_avg_k("") == {}
    assert samples_per_question("AIME24", {"aime24": 32}) == 32
    assert samples_per_question("math500", {"aime24": 32}) == 1
    for bad in ("aime24", "aime24=0", "=3", "aime24=x"):
        with pytest.raises(ValueError):
            parse_avg_k(bad)


def _record(source, q, correct, mv=None, boxed=None):
    mv = correct if mv is None else mv
    boxed = correct if boxed is None else boxed
    return {"data_source": source, "question_index": q, "correct": correct, "boxed_correct": boxed,
            "math_verify_correct": mv, "disagree": boxed != mv, "finish_reason": "eos"}


def test_avg_at_k_and_pass_at_1_on_scripted_labels():
    labels = {0: [1, 1, 0, 0], 1: [1, 1, 1, 0]}  # aime24, k = 4
    records = [_record("aime24", q, bool(c)) for q, cs in labels.items() for c in cs]
    records += [_record("math500", 10 + i, bool(c)) for i, c in enumerate([1, 0, 1, 1, 0])]
    records.append(_record("math500", 15, False, mv=True))  # a Math-Verify disagreement
    table = aggregate(records)
    expected_avg4 = np.mean([np.mean(np.array(cs, dtype=np.float64)) for cs in labels.values()])
    assert table["aime24"]["metric"] == "avg@4"
    assert table["aime24"]["accuracy"] == pytest.approx(expected_avg4) == pytest.approx(0.625)
    assert (table["aime24"]["questions"], table["aime24"]["generations"]) == (2, 8)
    assert table["math500"]["metric"] == "pass@1"
    assert table["math500"]["accuracy"] == pytest.approx(3 / 6)
    assert table["math500"]["math_verify_accuracy"] == pytest.approx(4 / 6)
    assert table["math500"]["disagreements"] == 1


# ----------------------------------------------------------------------------------------- pipeline (scripted)
SCRIPT = {  # question -> responses (the prompt already ends with "<think>\n", so "</think>" is required)
    "What is 2+3?": ["add </think> \\boxed{5}", "guess </think> \\boxed{4}", "</think> so \\boxed{5}.",
                     "</think> The answer is 5"],  # boxed 2/4; the last one: Math-Verify says correct
    "What is 10/4?": ["</think> \\boxed{\\dfrac{5}{2}}", "</think> \\boxed{2.5}", "no closing tag \\boxed{5/2}",
                      "</think> \\boxed{5/2}"],  # 3/4
    "Compute 7*6.": ["</think> \\boxed{42}"],
    "What is each angle of an equilateral triangle, in degrees?": ["</think> \\boxed{60^\\circ}"],
    "What is half of 1?": ["</think> \\boxed{0.4}"],
    "A car moves 6 m in 2 s. What is its speed in m/s?": ["</think> \\boxed{3\\text{ m/s}}"],
}


class ScriptedEngine:
    """RolloutEngine test double: predetermined response texts per prompt (generation is not under test)."""

    tokens_per_second = 0.0

    def __init__(self, tokenizer, template: str):
        self.tokenizer = tokenizer
        self.by_prompt = {tuple(tokenizer.encode(render_prompt(q, template))): rs for q, rs in SCRIPT.items()}
        self.calls: list[tuple[int, int, list[int] | None]] = []

    def generate(self, prompts, n, params: SamplingParams, request_seeds=None, on_prompts_done=None):
        self.calls.append((len(prompts), n, request_seeds))
        out = []
        for p in prompts:
            texts = self.by_prompt[tuple(p)]
            assert len(texts) == n
            out.append([Sample(list(p), self.tokenizer.encode(t) + [self.tokenizer.eos_token_id],
                               [0.0] * (len(self.tokenizer.encode(t)) + 1), "eos") for t in texts])
        for i in reversed(range(len(prompts))) if on_prompts_done else []:  # prompts finishing last to first
            on_prompts_done([i], [out[i]])
        return out

    def update_weights(self):
        pass

    def sleep(self):
        self.calls.append(("sleep",))

    def wake(self):
        self.calls.append(("wake",))


def test_fixture_pipeline_with_scripted_answers(tmp_path):
    tok = CharTokenizer()
    dataset = load_prompt_dataset(FIXTURE, tokenizer=tok, template="plain", max_prompt_length=512)
    questions = group_questions(dataset)
    assert len(dataset) == 7 and len(questions) == 6  # the duplicated AIME row is one question
    assert questions[0].qids == [0, 2]
    engine = ScriptedEngine(tok, "plain")
    settings = EvalSettings(template="plain", avg_k={"aime24": 4}, prompts_per_call=2)
    path = str(tmp_path / "gen.jsonl")
    with BenchmarkGrading(num_workers=2) as grading:
        records = evaluate_questions(questions, RolloutService(engine), tok, settings, jsonl_path=path,
                                     grading=grading)
    table = aggregate(records)

    assert engine.calls[0] == ("wake",) and engine.calls[-1] == ("sleep",)  # awake once for every call
    calls = engine.calls[1:-1]
    assert [(p, n) for p, n, _ in calls] == [(2, 1), (2, 1), (2, 4)]  # k=1 prompts in blocks of 2, then k=4
    assert [seeds for _, _, seeds in calls] == [[2, 3], [4, 5], [0, 1]]  # request seeds = question indices
    order = [(2, 0), (3, 0), (4, 0), (5, 0)] + [(q, j) for q in (0, 1) for j in range(4)]  # question, sample
    assert [(r["question_index"], r["sample_index"]) for r in records] == order  # generation order
    assert table["aime24"]["metric"] == "avg@4"
    assert table["aime24"]["accuracy"] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert table["aime24"]["math_verify_accuracy"] == pytest.approx((3 / 4 + 3 / 4) / 2)
    assert table["aime24"]["disagreements"] == 1
    assert table["math500"]["metric"] == "pass@1"
    assert table["math500"]["accuracy"] == pytest.approx(2 / 3)
    assert table["minerva"]["accuracy"] == 1.0
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert lines == records and len(lines) == 2 * 4 + 3 + 1
    first = lines[[r["question"] for r in lines].index("What is 2+3?") + 3]
    assert first["gold"] == "5" and first["response"] == "</think> The answer is 5"
    assert (first["boxed_correct"], first["math_verify_correct"], first["correct"], first["disagree"]) == (
        False, True, False, True)


def test_cli_reports_missing_files(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--model", str(tmp_path), "--data", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--model", str(tmp_path / "no_model"), "--data", FIXTURE])


# ----------------------------------------------------------------------------------------- real end-to-end
def _save_checkpoint_and_evaluate(step_dir: str, out_dir: str) -> dict:
    """Build a tiny random model (TP=1), save it in the trainer's step layout, then run the CLI's main()."""
    from megatron.core import dist_checkpointing

    from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig
    from exgrpo_megatron.convert.hf_config import save_model_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    init_distributed(1, 1, seed=11)
    cfg = ModelConfig(params_dtype="fp32", layer_spec="local")  # tiny_qwen2 shape, vocab 128 >= CharTokenizer's
    model = build_gpt_model(cfg, ParallelConfig())
    os.makedirs(os.path.join(step_dir, "model"), exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, os.path.join(step_dir, "model"))
    save_model_config(cfg, step_dir)
    with open(os.path.join(os.path.dirname(step_dir), "latest"), "w") as fh:
        fh.write(os.path.basename(step_dir))
    del model
    return main(["--model", os.path.dirname(step_dir), "--data", FIXTURE, "--tokenizer", "char",
                 "--template", "plain", "--max-new-tokens", "8", "--avg-k", "aime24=2", "--out", out_dir])


def test_end_to_end_on_tiny_checkpoint(tmp_path):
    """Real MegatronRolloutEngine on a saved checkpoint, addressed by its `checkpoints/` dir (follows `latest`)."""
    step_dir = str(tmp_path / "run" / "checkpoints" / "step_00000001")
    out = tmp_path / "out"
    table = run_on_ranks(_save_checkpoint_and_evaluate, 1, args=(step_dir, str(out)))[0]
    lines = [json.loads(line) for line in open(out / "generations.jsonl", encoding="utf-8")]
    assert len(lines) == 2 * 2 + 3 + 1  # (unique question x k)
    assert all(1 <= r["response_tokens"] <= 8 for r in lines)
    assert {r["finish_reason"] for r in lines} <= {"eos", "length"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"] == table
    assert set(table) == {"aime24", "math500", "minerva"}
    assert table["aime24"]["metric"] == "avg@2" and table["math500"]["metric"] == "pass@1"
    for row in table.values():
        assert 0.0 <= row["accuracy"] <= 1.0
