"""The generation-ahead GPU plan (planning/generation_split.py), its dry-run section, and the Slurm launch with
--max-staleness (faked Slurm, the helpers of test_slurm)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from exgrpo_megatron.planning.generation_split import (
    DEFAULT_PHASE_TIMES,
    PhaseTimes,
    best_split,
    read_phase_times,
    speedup,
    split_times,
    trainer_layout_ok,
)
from exgrpo_megatron.train import main as train_main
from tests.helpers.preset_inputs import preset_inputs
from tests.test_slurm import _run_script

REPO = Path(__file__).resolve().parents[1]


def _times(g: float, t: float) -> PhaseTimes:
    return PhaseTimes(g, t, "test")


def test_split_times_exact_small_cases() -> None:
    times = _times(3.0, 1.0)  # N = 4: gen 12/g, train 4/(4-g)
    assert [(s.generate, s.train, s.step) for s in (split_times(times, 4, g) for g in (1, 2, 3))] == \
        [(12.0, 4 / 3, 12.0), (6.0, 2.0, 6.0), (4.0, 4.0, 4.0)]
    best = best_split(times, 4)
    assert (best.gen_gpus, best.train_gpus, best.step, speedup(times, best)) == (3, 1, 4.0, 1.0)
    assert speedup(times, split_times(times, 4, 1)) == pytest.approx(4 / 12)
    with pytest.raises(ValueError):
        split_times(times, 4, 4)


def test_ties_go_to_fewer_generation_gpus() -> None:
    # N = 3, G = T = 1: g=1 -> max(3, 1.5) = 3; g=2 -> max(1.5, 3) = 3
    assert best_split(_times(1.0, 1.0), 3).gen_gpus == 1
    assert best_split(_times(1.0, 1.0), 4).gen_gpus == 2  # 2 + 2 GPUs: both phases take G + T


def test_best_split_against_brute_force_and_the_bound() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n, times = rng.randint(2, 64), _times(rng.uniform(0.1, 100), rng.uniform(0.1, 100))
        steps = [max(times.generate * n / g, times.train * n / (n - g)) for g in range(1, n)]
        best = best_split(times, n)
        assert best.step == min(steps)
        assert best.gen_gpus == 1 + steps.index(min(steps))  # the first minimum: fewest generation GPUs
        assert best.step >= times.colocated * (1 - 1e-12)  # perfect scaling never beats G + T


def _write_metrics(run_dir: Path, records: list[dict], torn: bool = False) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + ('{"step": 9, "time/gen' if torn else "")
    (run_dir / "metrics.jsonl").write_text(text)


def test_read_phase_times_skips_the_first_step(tmp_path: Path) -> None:
    _write_metrics(tmp_path, [{"step": 3, "time/generate": 5.0, "time/train": 1.0},
                              {"step": 1, "time/generate": 100.0, "time/train": 100.0},
                              {"step": 2, "time/generate": 3.0, "time/train": 2.0}], torn=True)
    times = read_phase_times(str(tmp_path))
    assert (times.generate, times.train, times.measured) == (4.0, 1.5, True)
    _write_metrics(tmp_path / "short", [{"step": 1, "time/generate": 1.0, "time/train": 1.0}])
    with pytest.raises(ValueError, match="at least two steps"):
        read_phase_times(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="no such file"):
        read_phase_times(str(tmp_path / "missing"))


def test_default_ratio_is_the_measured_cpu_run() -> None:
    steps = json.loads((REPO / "bench/results/real_model_e2e.json").read_text())["arms"]["megatron"]["steps"]
    for key, value in (("generate_s", DEFAULT_PHASE_TIMES.generate), ("train_s", DEFAULT_PHASE_TIMES.train)):
        measured = steps[key][1:]
        assert value == pytest.approx(sum(measured) / len(measured), abs=0.005)
    assert not DEFAULT_PHASE_TIMES.measured


def test_trainer_layout_ok() -> None:
    assert trainer_layout_ok(16, 2, 64) and trainer_layout_ok(14, 2, 56)
    assert not trainer_layout_ok(7, 2, 64) and not trainer_layout_ok(14, 2, 64)


# --- the dry run ----------------------------------------------------------------------------------------

STALE_7B = ["rollout.max_staleness=1", "algo.fresh_is_cap=2.0", "trainer.train_batch_size=112",
            "trainer.ppo_mini_batch_size=56"]


def test_dry_run_prints_the_plan_from_a_run(tmp_path: Path, capsys, preset_paths) -> None:
    data = preset_paths
    run = tmp_path / "colocated"
    _write_metrics(run, [{"step": s, "time/generate": 30.0, "time/train": 10.0} for s in (1, 2, 3)])
    head = ["--config-name", "exgrpo_7b", "--dry-run", "--world-size", "14", "--phase-times"]
    args = [*head, str(run), *data, *STALE_7B[2:]]
    assert train_main([*args, *STALE_7B[:2]]) == 0
    out = capsys.readouterr().out
    # N = 14 training ranks + the generator = 15; G = 30, T = 10: gen 450/g, train 150/(15-g); g=11: 40.91
    assert "generation one step ahead on N=15 GPUs" in out
    assert "colocated step 40.0 s (measured:" in out
    assert "best split: g=11 generate + 4 train: step 1.02 x colocated (40.9 s: gen 40.9 s, train 37.5 s), " \
           "speed-up x0.98" in out
    assert "this release (one generator process on one GPU): g=1 generate + 14 train: step 11.25 x colocated " \
           "(450.0 s: gen 450.0 s, train 10.7 s), speed-up x0.09" in out
    assert train_main(args) == 0  # colocated at 14 GPUs: one hint line only
    out = capsys.readouterr().out
    assert "hint: generating one step ahead (rollout.max_staleness=1) on 14 GPUs" in out
    assert "generation one step ahead on" not in out
    assert train_main([*head, str(tmp_path / "nowhere"), *data, *STALE_7B]) == 2
    assert "no such file" in capsys.readouterr().err


# --- Slurm ----------------------------------------------------------------------------------------------

def _sruns(calls: list[list[str]]) -> list[list[str]]:
    return [c[1:] for c in calls if c[0] == "srun"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_7b_script_one_step_off_leaves_the_generator_a_gpu(tmp_path: Path, how: str) -> None:
    env, data = preset_inputs(tmp_path)
    batch = STALE_7B[2:]
    args = ["--max-staleness", "1", *data, *batch] if how == "flag" else [*data, *batch]
    extra = {**env, **({"MAX_STALENESS": "1"} if how == "env" else {})}
    result, calls = _run_script(tmp_path, "exgrpo_7b.sh", args, nnodes=2, extra_env=extra)
    assert result.returncode == 0, result.stderr
    dry, train = _sruns(calls)
    assert dry[dry.index("--world-size") + 1] == "14"
    assert {"--nodes=2", "--ntasks=14", "--ntasks-per-node=7"} <= set(train)
    run_dir = str(tmp_path / "runs" / "exgrpo_7b-4242")
    assert train[-8:] == [f"logging.run_dir={run_dir}", "checkpoint.resume=auto", "rollout.max_staleness=1",
                          "algo.fresh_is_cap=2.0", *data, *batch]
    report = (Path(run_dir) / "slurm" / "job-4242-restart-0" / "dry_run.txt").read_text()
    assert "generation one step ahead on N=15 GPUs" in report


def test_script_user_cap_wins_and_bad_staleness_stops(tmp_path: Path) -> None:
    env, data = preset_inputs(tmp_path)
    args = ["--max-staleness=2", *data, *STALE_7B[2:], "algo.fresh_is_cap=3.0"]
    result, calls = _run_script(tmp_path, "exgrpo_7b.sh", args, nnodes=2, extra_env=env)
    assert result.returncode == 0, result.stderr
    train = _sruns(calls)[-1]
    assert "rollout.max_staleness=2" in train and train[-1] == "algo.fresh_is_cap=3.0"
    for bad_args, bad_env in ((["--max-staleness", "x"], {}), (["rollout.max_staleness=1"], {}),
                              ([], {"MAX_STALENESS": "-1"})):
        result, calls = _run_script(tmp_path, "exgrpo_7b.sh", [*bad_args, *data], nnodes=1,
                                    extra_env={**env, **bad_env})
        assert result.returncode == 2 and not _sruns(calls), (bad_args, result.stderr)


def test_7b_script_one_node_one_step_off_is_refused_by_the_dry_run(tmp_path: Path) -> None:
    """7 training ranks cannot hold TP=2: the dry run stops the job before training."""
    env, data = preset_inputs(tmp_path)
    result, calls = _run_script(tmp_path, "exgrpo_7b.sh", ["--max-staleness", "1", *data], nnodes=1, extra_env=env)
    assert result.returncode == 2 and "world size 7" in result.stderr
    assert len(_sruns(calls)) == 1
