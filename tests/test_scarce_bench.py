"""The data-scarce regime: its presets (conf/scarce_<n>_cpu.yaml), the bench protocol that runs it
(bench/exgrpo_vs_grpo.py --protocol scarce) and its analysis against the pre-registered criteria
(bench/scarce_analysis.py), the latter on synthetic records with known answers and a partial grid."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from exgrpo_megatron.config.loader import load_config, to_yaml
from exgrpo_megatron.config.validate import all_errors
from exgrpo_megatron.policy.warm_start import cache_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import experiment_arms as arms  # noqa: E402
import scarce_analysis as sa  # noqa: E402

from tests.test_fidelity_knobs import _bench_module  # noqa: E402


@pytest.mark.parametrize(("questions", "epochs"), [(256, 10), (1024, 8)])
def test_scarce_presets_are_the_pre_registered_regime(questions, epochs):
    """A fixed set of n questions for 10 / 8 epochs at B = 8 x K = 8, 2 updates per step, fp32, lr 2.5e-5, held-out
    validation 256 / test 512 at paper_ratio_cpu's tiers, and paper_ratio_cpu's capable warm start itself (same
    cache entry), so the regime differs from the paper-ratio one only in the set's size and the epochs."""
    cfg, paper = load_config(f"scarce_{questions}_cpu"), load_config("paper_ratio_cpu")
    t, d = cfg.trainer, cfg.data
    assert all_errors(cfg, 1, check_paths=False) == []
    assert d.num_train_examples == questions and t.total_steps * t.train_batch_size == epochs * questions
    assert (t.train_batch_size, cfg.rollout.n, t.train_batch_size // t.ppo_mini_batch_size) == (8, 8, 2)
    assert (d.num_val_examples, d.num_test_examples) == (256, 512)
    assert cfg.optim.lr == arms.SCARCE_LR == 2.5e-5 and cfg.model.params_dtype == "fp32"
    assert d.arithmetic_tiers == paper.data.arithmetic_tiers
    assert cache_key(cfg) == cache_key(paper)
    assert cache_key(load_config(f"scarce_{questions}_cpu", ["trainer.sft_warm_start_examples=0"])) != cache_key(paper)


def test_scarce_plan_runs_every_available_arm_on_its_own_preset_and_never_a_finished_one(tmp_path):
    bench = _bench_module()
    args = bench.parse(["--protocol", "scarce", "--root", str(tmp_path / "runs"), "--records",
                        str(tmp_path / "records")])
    runs = bench.plan_runs(args, {"exgrpo": None, "grpo": None})
    waiting = arms.scarce_unavailable()
    assert all(name.removeprefix("weak_").startswith(("ingroup_replay", "rescue_replay")) for name in waiting)
    assert {r.variant for r in runs} == set(arms.SCARCE) - set(waiting)
    assert len(runs) == len(args.seeds) * (len(arms.SCARCE) - len(waiting)) and args.seeds == [1, 2, 3, 4, 5]
    assert all(r.lr == arms.SCARCE_LR and r.config_name == f"scarce_{r.variant.rsplit('_q', 1)[1]}_cpu" for r in runs)
    assert arms.SCARCE["grpo_extra_pass_q256"] == ["algo.name=grpo", "trainer.update_epochs=2"]
    assert "experience.max_age_steps=96" in arms.SCARCE["ingroup_replay_q256"]
    assert "experience.max_age_steps=384" in arms.SCARCE["weak_ingroup_replay_q1024"]
    assert arms.SCARCE["exgrpo_append_q256"] == ["experience.placement=append", "experience.ratio=0.25"]
    for name, overrides in arms.SCARCE.items():
        assert name.startswith("weak_") == all(o in overrides for o in arms.WEAK_START_OVERRIDES), name
    weak = next(r for r in runs if r.variant == "weak_grpo_q256" and r.seed == 1)
    capable = next(r for r in runs if r.variant == "grpo_q1024" and r.seed == 1)
    argv = bench.eval_argv(args, weak)
    assert argv.count("--counts") == 2 and argv[-2:] == ["--out", os.path.join(weak.run_dir, "test_eval.json")]
    assert "start_train_probe.json" in " ".join(argv) and "--counts" not in bench.eval_argv(args, capable)
    assert bench.train_argv(args, weak)[4] == "scarce_256_cpu"
    assert bench.warm_start_ready(args, capable) != bench.warm_start_ready(args, weak)
    record = Path(capable.record_dir)
    record.mkdir(parents=True)
    (record / "test_eval.json").write_text("{}")
    assert capable.done and capable not in [r for r in bench.plan_runs(args, {}) if not r.done]


# ---------------------------------------------------------------------------------------- synthetic records
STEPS, VAL_EVERY, PER_STEP = 320, 32, 64


def _record(root: Path, variant: str, seed: int, reach_step: int, greedy: float, per_step: float = PER_STEP,
            tokens_per_step: float = 1000.0, probes: tuple[list[int], list[int]] | None = None) -> None:
    """A finished run's record: validation climbing linearly to 0.6 at `reach_step`, then 0.6 (GRPO: 320)."""
    d = root / os.path.basename(sa.fa.run_dir(str(root), variant, arms.SCARCE_LR, seed))
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(to_yaml(load_config("scarce_256_cpu")))
    lines = []
    for step in range(1, STEPS + 1):
        m = {"step": step, "generation/trajectories": per_step, "train/tokens": tokens_per_step}
        if step % VAL_EVERY == 0:
            m["val/avg@1"] = round(min(0.6, 0.6 * step / reach_step), 6)
        lines.append(json.dumps(m))
    (d / "metrics.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    (d / "test_eval.json").write_text(json.dumps({"greedy": greedy, "avg@8_T0.6": greedy, "avg@8_T1": greedy}))
    if probes:
        for name, counts in zip(("start_train_probe.json", "train_probe.json"), probes, strict=True):
            (d / name).write_text(json.dumps({sa.PROBE_KEY: counts}))


def _grid(root: Path) -> None:
    """Capable and weak start at 256 questions, 5 seeds (a verdict needs 5). in-group replay reaches GRPO's peak at
    steps 160/192/160/160/160 (savings .5/.4/.5/.5/.5) and ends 5 points above it; the extra pass does exactly what
    in-group replay does (so in-group replay is "more updates, not replay"); append generates 80 per step on 2 seeds;
    rescue replay has one seed only."""
    start = [0] * 5 + [1] * 5 + [2] * 2 + [5] * 4  # 10 questions at <= 1/8 at the warm start (2/8 is not hard)
    for prefix in ("", "weak_"):
        for seed in (1, 2, 3, 4, 5):
            climbed = {"grpo": 2, "replay": 5 + seed % 2}
            probes = {k: (start, [4] * v + [0] * (10 - v) + [8] * 6) for k, v in climbed.items()} if prefix else {}
            _record(root, f"{prefix}grpo_q256", seed, 320, 0.50 + 0.01 * seed, probes=probes.get("grpo"))
            for arm in ("ingroup_replay", "grpo_extra_pass"):
                _record(root, f"{prefix}{arm}_q256", seed, 160 if seed != 2 else 192, 0.55 + 0.01 * seed + 0.002 * seed
                        ** 2, tokens_per_step=2000.0, probes=probes.get("replay"))
        for seed in (1, 2):
            _record(root, f"{prefix}exgrpo_append_q256", seed, 320, 0.5, per_step=80)
        _record(root, f"{prefix}rescue_replay_q256", 1, 320, 0.5)


def test_scarce_analysis_reads_partial_grids_and_applies_the_pre_registered_criteria(tmp_path):
    _grid(tmp_path / "records")
    png = tmp_path / "results" / "scarce.png"
    out = sa.analyse(str(tmp_path / "records"), [1, 2, 3, 4, 5], str(png))
    assert set(out["cells"]) == {"capable_256", "weak_256"} and png.is_file()  # no 1,024-question records yet
    for name, cell in out["cells"].items():
        assert cell["seeds_per_arm"] == {"grpo": 5, "grpo_extra_pass": 5, "ingroup_replay": 5, "rescue_replay": 1,
                                         "exgrpo_append": 2}, name
        ingroup = cell["versus"]["ingroup_replay"]["grpo"]
        assert ingroup["seeds"] == [1, 2, 3, 4, 5] and ingroup["a_measure"].startswith("greedy test accuracy")
        assert ingroup["a"]["mean"] == pytest.approx(0.05 + 0.002 * 55 / 5)
        assert ingroup["b_saving"]["mean"] == pytest.approx((0.5 + 0.4 + 0.5 + 0.5 + 0.5) / 5)
        assert ingroup["verdict"]["a"] == "pays" and ingroup["verdict"]["b"] == "pays"
        assert ingroup["per_trajectory_val"]["mean"] == 0.0  # both at 0.6 at the end: equal generation
        # twice the training tokens per step: at GRPO's total tokens, in-group replay is at step 160 (seed 2: 0.5)
        assert ingroup["per_token_val"]["mean"] == pytest.approx(-0.1 / 5)
        versus_extra = cell["versus"]["ingroup_replay"]["grpo_extra_pass"]
        assert versus_extra["a"]["mean"] == 0.0 and versus_extra["verdict"]["a"] == "does not pay"
        expected = ["a", "b", "c"] if name.startswith("weak") else ["a", "b"]
        assert cell["more_updates_not_replay"] == {"ingroup_replay": expected}
        assert cell["verdicts"]["ingroup_replay"] == dict.fromkeys(expected, "more updates, not replay")
        assert cell["verdicts"]["grpo_extra_pass"]["a"] == "pays"  # not a replay arm: its verdict against GRPO
        assert cell["versus"]["rescue_replay"]["grpo"]["verdict"]["a"] == "too few seeds (1)"
        append = cell["versus"]["exgrpo_append"]["grpo"]
        assert append["a_measure"].startswith("validation accuracy at the common generation budget")
        assert append["b_saving"]["mean"] == pytest.approx(1 - 80 / 64)  # GRPO's peak at the same step, 80 vs 64
        assert append["verdict"]["b"] == "too few seeds (2)"  # no verdict below 5 paired seeds
        assert "rescue_replay" not in cell["versus"].get("exgrpo_append", {})
    weak = out["cells"]["weak_256"]
    climb = weak["versus"]["ingroup_replay"]["grpo"]["c_climbed"]
    assert climb["mean"] == pytest.approx((4 + 3 + 4 + 3 + 4) / 5)
    assert weak["versus"]["ingroup_replay"]["grpo"]["verdict"]["c"] == "pays"
    assert weak["arms"]["grpo"]["hard_questions"]["mean"] == 10 and weak["arms"]["grpo"]["hard_climbed"]["mean"] == 2
    assert "c_climbed" not in out["cells"]["capable_256"]["versus"]["ingroup_replay"]["grpo"]
    text = sa.markdown(out)
    assert "| rescue_replay | 1 |" in text
    assert "| ingroup_replay | more updates, not replay | more updates, not replay | more updates, not replay |" in text
    assert "| rescue_replay | too few seeds (1) | too few seeds (1) | n/a |" in text  # (c): weak start only


def test_an_arm_verdict_credits_replay_only_beyond_one_more_update_pass():
    assert sa.arm_verdict("pays", "pays") == "replay pays"
    assert sa.arm_verdict("pays", "does not pay") == "more updates, not replay"
    assert sa.arm_verdict("pays", "does not pay (the interval still reaches 0 at 10 seeds)") == \
        "more updates, not replay"
    assert sa.arm_verdict("pays", "straddles: extend to 10 seeds") == \
        "pays against GRPO; against one more pass: straddles: extend to 10 seeds"  # pending, not yet a label
    assert sa.arm_verdict("pays", "too few seeds (3)").endswith("too few seeds (3)")
    assert sa.arm_verdict("pays", None) == "pays"  # one more pass itself, ExGRPO append: no second baseline
    for verdict in ("does not pay", "straddles: extend to 10 seeds", "too few seeds (4)"):
        assert sa.arm_verdict(verdict, "pays") == verdict  # against one more pass it decides nothing


def test_judge_reads_an_interval_as_pre_registered():
    assert sa.judge({"mean": 0.3, "ci95": 0.1, "n": 5}, 0.25) == "pays"
    assert sa.judge({"mean": 0.3, "ci95": 0.4, "n": 5}, 0.25) == "straddles: extend to 10 seeds"
    assert sa.judge({"mean": 0.2, "ci95": 0.1, "n": 5}, 0.25) == "does not pay"  # the saving threshold is not met
    assert sa.judge({"mean": -0.01, "ci95": 0.1, "n": 5}) == "does not pay"
    assert sa.judge({"mean": 0.01, "ci95": None, "n": 1}) == "too few seeds (1)"
    assert sa.judge({"mean": 0.3, "ci95": 0.1, "n": 4}) == "too few seeds (4)"  # no verdict below 5 paired seeds
    assert sa.judge({"mean": 0.3, "ci95": 0.4, "n": 10}) == "does not pay (the interval still reaches 0 at 10 seeds)"
    assert sa.judge({"mean": 0.3, "ci95": 0.1, "n": 10}) == "pays"


def test_imported_records_keep_their_metrics(tmp_path):
    """A pinned checkout's finished records come into this one's records with every file, the compressed metrics
    included (the source is itself a record: metrics.jsonl.gz, no metrics.jsonl)."""
    import run_records

    run_dir, pinned, here = tmp_path / "run", tmp_path / "pinned", tmp_path / "here"
    run_dir.mkdir()
    metrics = "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(1, 4))
    (run_dir / "metrics.jsonl").write_text(metrics)
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "test_eval.json").write_text("{}")
    run_records.keep_record(str(run_dir), str(pinned / "grpo_seed1"))
    (pinned / "unfinished").mkdir()
    assert run_records.import_records(str(pinned), str(here)) == ["grpo_seed1"]
    with gzip.open(here / "grpo_seed1" / "metrics.jsonl.gz", "rt") as f:
        assert f.read() == metrics
    assert sorted(os.listdir(here / "grpo_seed1")) == ["config.yaml", "metrics.jsonl.gz", "test_eval.json"]
    assert run_records.import_records(str(pinned), str(here)) == []  # a finished record is never taken twice
