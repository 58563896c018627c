"""In-group replay in the real trainer (`train_config`, one process per rank, as tests/test_trainer_resume.py): a
tiny model that answers "7" often, on 8 questions so that every question comes back every other step.

* the run replays: steps after a question's first visit train stored responses (replay/token_fraction > 0) and the
  store's size is logged; a step generates only its K fresh rollouts per question;
* a run stopped after step 3 and resumed reproduces the uninterrupted run bitwise: every step's metrics, the final
  weights and Adam moments, the trainer state and the response store in the checkpoint;
* the pool file written with the last checkpoint holds that checkpoint's store; a new run reading it replays from
  step 1 (RLEP); a pool file with a flipped byte, or one written for other questions, stops the run at start-up with
  exit 2 naming experience.pool_file_in, before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from exgrpo_megatron.checkpoint.pool_file import merge_states, read_pool_file
from exgrpo_megatron.logging import read_metrics
from tests.test_trainer_resume import (
    _assert_same_metrics,
    _assert_same_tensors,
    _ckpt,
    _json,
    _model_tensors,
    _pool_shards,
    _train,
)
from tests.test_trainer_resume import _overrides as _resume_overrides

N_STEPS, K, BATCH = 6, 4, 4


def _write_dataset(path: Path, n: int = 8, tag: str = "q") -> str:
    golds = ("7", "7", "77")
    rows = [{"prompt": f"{tag}{i}: what is {i}+{i}?", "reward_model": {"ground_truth": golds[i % 3]}}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _overrides(data: str, steps: int, *extra: str) -> list[str]:
    return _resume_overrides(data, steps, extra=(
        "algo.name=ingroup_replay", "experience.ingroup_size=3", "experience.max_age_steps=3",
        *extra))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("response_replay")
    data = _write_dataset(root / "train.jsonl")
    run_dir, init = root / "reference", root / "init"
    pool_file = root / "pool_out.safetensors"
    _train(run_dir, _overrides(data, N_STEPS, f"experience.pool_file_out={pool_file}"),
           worker_args=("--make-init", str(init)))
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, N_STEPS + 1))
    return {"root": root, "data": data, "init": init, "run_dir": run_dir, "metrics": metrics, "pool_file": pool_file}


def test_the_run_replays_stored_responses_and_generates_only_the_fresh_ones(reference):
    metrics = reference["metrics"]
    assert any(m["reward/mean"] > 0 for m in metrics)
    # steps 1-2 visit the 8 questions once each: nothing stored for them yet; from step 3 on every group gains some
    assert [m["replay/token_fraction"] > 0 for m in metrics] == [False, False, True, True, True, True]
    for m in metrics:
        assert m["generation/trajectories"] == BATCH * K
        assert 0 < m["responses/stored"] <= 8 * 3 and m["responses/questions"] == min(8, BATCH * m["step"])


def test_a_stopped_and_resumed_run_reproduces_the_uninterrupted_run_bitwise(reference, tmp_path):
    run_dir = tmp_path / "interrupted"
    pool_file = reference["root"] / "pool_out_interrupted.safetensors"
    _train(run_dir, _overrides(reference["data"], 3, f"experience.pool_file_out={pool_file}"),
           worker_args=("--make-init", str(tmp_path / "init")), tag="a")
    log = _train(run_dir, _overrides(reference["data"], N_STEPS, f"experience.pool_file_out={pool_file}"), tag="b")
    assert f"resumed from {_ckpt(run_dir, 3)} at step 3" in log
    _assert_same_metrics(run_dir, reference["metrics"])
    got, want = _ckpt(run_dir, N_STEPS), _ckpt(reference["run_dir"], N_STEPS)
    _assert_same_tensors(_model_tensors(got, tmp_path), _model_tensors(want, tmp_path))
    assert _json(got / "state" / "trainer_state.json") == _json(want / "state" / "trainer_state.json")
    (arrays, meta), = _pool_shards(got)
    (want_arrays, want_meta), = _pool_shards(want)
    assert meta == want_meta and meta["format"] == "exgrpo_response_store" and len(arrays["qids"]) == 8
    for name in want_arrays:
        np.testing.assert_array_equal(arrays[name], want_arrays[name], err_msg=name)
    assert pool_file.read_bytes() == reference["pool_file"].read_bytes()


def _identity(data: str):
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.data.datasets import load_prompt_dataset
    from exgrpo_megatron.data.token_cache import tokenizer_fingerprint
    from exgrpo_megatron.data.tokenizer import load_tokenizer

    cfg = load_config("demo_cpu", _overrides(data, N_STEPS))
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path)
    dataset = load_prompt_dataset(cfg.data.train_files, prompt_key=cfg.data.prompt_key,
                                  answer_key=cfg.data.answer_key, tokenizer=tokenizer, template=cfg.data.template,
                                  max_prompt_length=cfg.data.max_prompt_length)
    return dict(vocab_size=cfg.model.vocab_size, tokenizer=tokenizer_fingerprint(tokenizer),
                prompt_ids=lambda q: dataset[q].prompt_ids)


def test_a_pool_file_carries_the_store_to_another_run(reference, tmp_path):
    state = read_pool_file(reference["pool_file"], **_identity(reference["data"]))
    (arrays, meta), = _pool_shards(_ckpt(reference["run_dir"], N_STEPS))
    merged = merge_states([{"arrays": arrays, "meta": meta}])
    for name in arrays:
        np.testing.assert_array_equal(state["arrays"][name], merged["arrays"][name], err_msg=name)
    run_dir = tmp_path / "rlep"
    log = _train(run_dir, _overrides(reference["data"], 1, f"experience.pool_file_in={reference['pool_file']}",
                                     "experience.ingroup_failures=false", f"checkpoint.init_from={reference['init']}"))
    assert f"response store from {reference['pool_file']}" in log
    assert ("response replay: each fresh group gains up to 3 of its question's newest stored responses (successes "
            f"only), none generated; stored responses replayed up to 3 steps old; initial store from "
            f"{reference['pool_file']}") in log
    first, = read_metrics(str(run_dir / "metrics.jsonl"))
    assert first["replay/token_fraction"] > 0 and first["reward/replay_mean"] == 1.0  # stored successes only


@pytest.mark.parametrize("damage", ["flip", "other_questions"])
def test_a_bad_pool_file_stops_the_run_with_exit_2_naming_the_key(reference, tmp_path, damage):
    data, pool_file = reference["data"], tmp_path / "pool.safetensors"
    shutil.copy(reference["pool_file"], pool_file)
    if damage == "flip":
        raw = bytearray(pool_file.read_bytes())
        raw[-20] ^= 0x04
        pool_file.write_bytes(bytes(raw))
        reason = "is corrupt"
    else:
        data = _write_dataset(tmp_path / "other.jsonl", tag="other")
        reason = "other training questions"
    run_dir = tmp_path / "refused"
    log = _train(run_dir, _overrides(data, 2, f"experience.pool_file_in={pool_file}",
                                     f"checkpoint.init_from={reference['init']}"), expect=2)
    assert "experience.pool_file_in:" in log and reason in log
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", ["rescue_replay", "ingroup_replay"])
def test_dp2_runs_replay_from_stores_split_over_the_ranks(reference, tmp_path, name):
    """DP=2 (each rank owns some of the 8 questions and generates others: fetching a question's responses is a
    collective every rank joins, with or without groups to enlarge). Rescue replay gains only stored successes, and
    only in groups whose fresh responses all failed: a replayed row's reward is 1 and the step's replayed rows are at
    most its all-fail groups."""
    run_dir = tmp_path / name
    overrides = [o for o in _overrides(reference["data"], N_STEPS, f"checkpoint.init_from={reference['init']}")
                 if not o.startswith("experience.ingroup_size") or name == "ingroup_replay"]
    overrides = [o.replace("algo.name=ingroup_replay", f"algo.name={name}") for o in overrides]
    _train(run_dir, overrides, world=2)
    metrics = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, N_STEPS + 1))
    assert sum(m["replay/token_fraction"] > 0 for m in metrics) >= 2
    for m in metrics:
        assert m["generation/trajectories"] == BATCH * K
        if name == "rescue_replay" and m["replay/token_fraction"] > 0:
            assert m["reward/replay_mean"] == 1.0
            assert m["responses/stored"] == m["responses/questions"]  # one success per question, no failure
