"""The paper's out-of-distribution benchmarks (ARC-c, GPQA-diamond, MMLU-Pro) as multiple choice: the reference's
question layout, the boxed answer-letter grader, the conversion of hub rows, and evaluate.py's table with
ID and OOD averages on small fixtures written for these tests (no row of the real sets), graded in worker
processes while the next engine call generates, with the same verdicts as grading inline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from exgrpo_megatron.data.datasets import load_prompt_dataset
from exgrpo_megatron.data.templates import render_prompt
from exgrpo_megatron.data.tokenizer import CharTokenizer
from exgrpo_megatron.evaluate import (
    EvalSettings,
    aggregate,
    averages,
    evaluate_questions,
    format_table,
    group_questions,
)
from exgrpo_megatron.reward import multiple_choice as mc
from exgrpo_megatron.reward.benchmark_grading import BenchmarkGrading, grade_generation
from exgrpo_megatron.rollout.types import Sample
from exgrpo_megatron.training.rollout_service import RolloutService

FIXTURES = Path(__file__).parent / "fixtures"
MC_FIXTURE, MATH_FIXTURE = str(FIXTURES / "eval_mc_small.jsonl"), str(FIXTURES / "eval_small.jsonl")
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------- prompt layout
def test_question_layouts_match_the_reference_files():
    assert mc.arc_question(" Which is a metal? ", list("ABCD"), ["wood", "iron", "glass", "salt"]) == (
        "Which is a metal?\n\nA) wood\nB) iron\nC) glass\nD) salt\n")
    assert mc.lettered_question("Pick one.", ["x", "y", "z", "w"]) == (
        "Answer the following multiple choice question. The last line of your response should be of the following "
        "format: 'ANSWER: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before "
        "answering.\n\nPick one.\n\nA) x\nB) y\nC) z\nD) w")
    assert "one of ABCDEFGHIJ." in mc.lettered_question("q", [str(i) for i in range(10)])
    with pytest.raises(ValueError):
        mc.lettered_question("q", [str(i) for i in range(11)])
    assert mc.option_labels(mc.arc_question("q", list("1234"), list("abcd"))) == list("1234")


def test_shuffled_options_are_seeded_and_the_gold_letter_points_at_the_correct_answer():
    golds = set()
    for seed in range(40):
        options, gold = mc.shuffled_options("right", ["w1", "w2", "w3"], seed)
        assert sorted(options) == ["right", "w1", "w2", "w3"] and options["ABCD".index(gold)] == "right"
        assert mc.shuffled_options("right", ["w1", "w2", "w3"], seed) == (options, gold)
        golds.add(gold)
    assert golds == set("ABCD")  # the position varies with the seed


# ----------------------------------------------------------------------------------------- letter grader
ARC_Q = mc.arc_question("Which is a metal?", list("ABCD"), ["wood", "iron", "glass", "salt"])
ARC_NUM_Q = mc.arc_question("Which is a gas?", list("1234"), ["ice", "steam", "rock", "sand"])
GRADES = [  # (response after "<think>\n", question, gold, extracted label, correct)
    ("iron conducts </think> The answer is \\boxed{B}", ARC_Q, "B", "B", True),
    ("</think> \\boxed{\\text{(B)}}", ARC_Q, "B", "B", True),
    ("</think> \\boxed{(B)}.", ARC_Q, "B", "B", True),
    ("</think> $\\boxed{B}$", ARC_Q, "B", "B", True),
    ("</think> \\boxed{C}", ARC_Q, "B", "C", False),
    ("</think> \\boxed{A} no wait \\boxed{B}", ARC_Q, "B", "B", True),  # the last box counts
    ("</think> \\boxed{B) iron}", ARC_Q, "B", None, False),  # the option's text is not a label (reference: wrong)
    ("</think> \\boxed{E}", ARC_Q, "B", None, False),  # not an option of this question
    ("</think> ANSWER: B", ARC_Q, "B", None, False),  # no box: wrong, as with the reference's boxed grader
    ("\\boxed{B} but no closing tag", ARC_Q, "B", None, False),  # think template: </think> required
    ("\\boxed{B} </think> final \\boxed{A}", ARC_Q, "B", "A", False),  # only after </think>
    ("</think> \\boxed{2}", ARC_NUM_Q, "2", "2", True),  # ARC's numeric labels
    ("</think> \\boxed{b}", ARC_Q, "B", None, False),  # labels are case-sensitive, as the reference compares
]


@pytest.mark.parametrize("response, question, gold, label, correct", GRADES)
def test_choice_grading_table(response, question, gold, label, correct):
    graded = mc.grade_choice(response, gold, question, require_think=True)
    assert (graded.prediction, graded.correct) == (label, correct)


def test_the_grade_of_a_multiple_choice_row_is_its_letter_and_math_rows_keep_the_math_grader():
    rec = grade_generation("</think> \\boxed{B}", "B", True, 2, "gpqa_diamond", ARC_Q)
    assert rec["boxed_answer"] == "B" and rec["correct"] is True
    rec = grade_generation("</think> \\boxed{B) iron}", "B", True, 2, "arc_c", ARC_Q)
    assert rec["correct"] is False
    rec = grade_generation("</think> \\boxed{0.5}", "\\frac{1}{2}", True, 2, "math500", "What is half of 1?")
    assert rec["correct"] is True and rec["boxed_answer"] == "0.5"


# ----------------------------------------------------------------------------------------- pipeline and table
SCRIPT = {  # question text -> responses; every question has k = 1 here
    "Compute 7*6.": "</think> \\boxed{42}",
    "What is each angle of an equilateral triangle, in degrees?": "</think> \\boxed{60^\\circ}",
    "What is half of 1?": "</think> \\boxed{0.4}",
    "A car moves 6 m in 2 s. What is its speed in m/s?": "</think> \\boxed{3}",
    "What is 2+3?": "</think> \\boxed{5}",
    "What is 10/4?": "</think> \\boxed{2.5}",
}
MC_ANSWERS = ["</think> \\boxed{B}", "</think> \\boxed{3}", "</think> ANSWER: C", "</think> \\boxed{B}",
              "</think> \\boxed{\\text{(A)}}"]  # arc_c 2/2, gpqa_diamond 1/2, mmlu_pro 0/1


class _Engine:
    """RolloutEngine test double with fixed texts per prompt (generation is not under test); logs its calls."""

    def __init__(self, tokenizer, responses: dict[tuple[int, ...], str], events: list[tuple[str, int]]):
        self.tokenizer, self.responses, self.events = tokenizer, responses, events

    def generate(self, prompts, n, params, request_seeds=None, on_prompts_done=None):
        self.events.append(("generate", len(prompts)))
        out = [[Sample(list(p), self.tokenizer.encode(self.responses[tuple(p)]) + [self.tokenizer.eos_token_id],
                       [0.0] * (len(self.tokenizer.encode(self.responses[tuple(p)])) + 1), "eos")] * n
               for p in prompts]
        if on_prompts_done is not None:  # the whole call is one batch
            on_prompts_done(list(range(len(prompts))), out)
        return out

    def wake(self):
        pass

    def sleep(self):
        pass


class _Verdict:
    def __init__(self, future, events):
        self._future, self._events = future, events

    def result(self):
        self._events.append(("result", 1))
        return self._future.result()


class _RecordingGrading:
    def __init__(self, inner: BenchmarkGrading, events: list[tuple[str, int]]):
        self.inner, self.events = inner, events

    def submit(self, *args):
        self.events.append(("submit", 1))
        return _Verdict(self.inner.submit(*args), self.events)


def _compress(events):
    out: list[list] = []
    for kind, n in events:
        if out and out[-1][0] == kind and kind != "generate":
            out[-1][1] += n
        else:
            out.append([kind, n])
    return [tuple(e) for e in out]


def test_id_and_ood_in_one_table_graded_while_generating(tmp_path):
    tok = CharTokenizer()
    dataset = load_prompt_dataset([MATH_FIXTURE, MC_FIXTURE], tokenizer=tok, template="plain", max_prompt_length=1024)
    questions = group_questions(dataset)
    mc_rows = [q for q in questions if mc.is_multiple_choice(q.data_source)]
    responses = {tuple(tok.encode(render_prompt(q, "plain"))): r for q, r in SCRIPT.items()}
    responses.update({tuple(q.prompt_ids): r for q, r in zip(mc_rows, MC_ANSWERS, strict=True)})
    events: list[tuple[str, int]] = []
    settings = EvalSettings(template="plain", avg_k={}, prompts_per_call=4)
    with BenchmarkGrading(num_workers=2, timeout_seconds=3) as grading:
        records = evaluate_questions(questions, RolloutService(_Engine(tok, responses, events)), tok, settings,
                                     jsonl_path=str(tmp_path / "gen.jsonl"), grading=_RecordingGrading(grading, events))
    # 11 questions in calls of 4, 4, 3: a call's verdicts are collected after the next call has generated
    assert _compress(events) == [("generate", 4), ("submit", 4), ("generate", 4), ("submit", 4), ("result", 4),
                                 ("generate", 3), ("submit", 3), ("result", 4 + 3)]
    for rec in records:  # the same verdicts as grading inline, after generation (the previous evaluate.py)
        inline = grade_generation(rec["response"], rec["gold"], True, settings.grade_timeout_seconds,
                                  rec["data_source"], rec["question"])
        assert {k: rec[k] for k in inline} == inline
    table = aggregate(records)
    assert list(table) == ["aime24", "math500", "minerva", "arc_c", "gpqa_diamond", "mmlu_pro"]
    assert (table["arc_c"]["accuracy"], table["gpqa_diamond"]["accuracy"], table["mmlu_pro"]["accuracy"]) == (
        1.0, 0.5, 0.0)
    assert table["aime24"]["accuracy"] == 1.0 and table["math500"]["accuracy"] == pytest.approx(2 / 3)
    avg = averages(table)
    assert avg["avg ID (math)"] == pytest.approx((1.0 + 2 / 3 + 1.0) / 3)
    assert avg["avg OOD"] == pytest.approx(0.5)
    assert avg["avg all"] == pytest.approx((1.0 + 2 / 3 + 1.0 + 1.0 + 0.5 + 0.0) / 6)
    lines = format_table(table).splitlines()
    assert [line.split()[0] for line in lines[-3:]] == ["avg", "avg", "avg"]
    assert lines[-2].startswith("avg OOD") and lines[-2].split()[-1] == "50.00"
    assert len(open(tmp_path / "gen.jsonl").readlines()) == len(records) == 11


# ----------------------------------------------------------------------------------------- hub rows -> schema
def _tool():
    spec = importlib.util.spec_from_file_location("prepare_data_mc", REPO / "tools" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare_data_mc"] = module
    spec.loader.exec_module(module)
    return module


def test_prepare_data_converts_multiple_choice_rows_into_the_benchmark_schema(tmp_path):
    tool = _tool()
    arc = {"question": "Which is a metal?", "answerKey": "B",
           "choices": {"label": ["A", "B", "C", "D"], "text": ["wood", "iron", "glass", "salt"]}}
    gpqa = {"Question": "Which is a noble gas?", "Correct Answer": " neon ", "Incorrect Answer 1": "oxygen",
            "Incorrect Answer 2": "sodium", "Incorrect Answer 3": "iron"}
    mmlu = {"question": "2+2?", "options": ["3", "4", "5", "6", "7"], "answer": "B"}
    out: dict[str, list] = {}
    for name, row in (("arc_c", arc), ("gpqa_diamond", gpqa), ("mmlu_pro", mmlu)):
        source = tool.OOD_BENCHMARKS[name]
        report, rows = tool.ConversionReport(), []
        tool.convert_records([(f"{name}:row 0", row), (f"{name}:row 1", {"question": "broken"})],
                             source.question_key, source.answer_key, name, name, report, rows, source.multiple_choice)
        assert report.kept == 1 and len(report.skipped) == 1  # a row without its option fields is reported
        tool.write_parquet(rows, tmp_path / f"{name}.parquet")
        out[name] = rows
    assert out["arc_c"][0]["prompt"] == "Which is a metal?\n\nA) wood\nB) iron\nC) glass\nD) salt"
    assert out["arc_c"][0]["reward_model"] == {"ground_truth": "B"}
    gpqa_prompt, gpqa_gold = out["gpqa_diamond"][0]["prompt"], out["gpqa_diamond"][0]["reward_model"]["ground_truth"]
    assert f"{gpqa_gold}) neon" in gpqa_prompt and "one of ABCD." in gpqa_prompt
    assert "E) 7" in out["mmlu_pro"][0]["prompt"] and "one of ABCDE." in out["mmlu_pro"][0]["prompt"]
    tok = CharTokenizer()
    data = load_prompt_dataset([str(tmp_path / f"{n}.parquet") for n in out], tokenizer=tok, template="plain",
                               max_prompt_length=2048)
    assert [ex.data_source for ex in data] == ["arc_c", "gpqa_diamond", "mmlu_pro"]
    for ex in data:  # the gold's boxed letter is correct under the grader
        assert mc.grade_choice(f"</think> \\boxed{{{ex.answer}}}", ex.answer, ex.question, True).correct
    assert set(tool.ALL_BENCHMARKS) == set(tool.BENCHMARKS) | {"arc_c", "gpqa_diamond", "mmlu_pro"}
