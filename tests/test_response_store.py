"""The response store (experience/response_store.py) and its pool file (checkpoint/pool_file.py), in one process:

* what a fresh group gains: in-group replay the newest r stored responses (failures too, or successes only), rescue
  replay one stored success and only when all K fresh responses fail;
* the staleness bound: a response collected at step s is replayed through step s + A at most;
* the state round trip is bitwise, and a run at another DP size keeps exactly the questions it owns;
* the pool file round trip, and every kind of bad file refused with a reason (corrupt, another vocabulary, other
  questions, not a pool file, a newer format); the variants' keys: refused by a variant that does not read them.
The store at DP=2 with unequal per-rank stores, and the loss of the enlarged groups: tests/test_ingroup_replay_loss.py.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from exgrpo_megatron.checkpoint.pool_file import (
    PoolFileError,
    export_store,
    import_store,
    read_pool_file,
    write_pool_file,
)
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.validate import response_store_key_errors
from exgrpo_megatron.data.step_plan import QuestionGroup
from exgrpo_megatron.experience.response_store import ResponseReplay, ResponseStore, StoredResponse
from exgrpo_megatron.rollout.group_filter import StepRollouts
from exgrpo_megatron.rollout.stored_responses import stored_outcomes, with_stored_responses
from exgrpo_megatron.rollout.types import Sample

PROMPTS = {q: [100 + q, 7, q % 5] for q in range(20)}
IDENTITY = dict(vocab_size=128, tokenizer="tok-a", prompt_ids=lambda q: PROMPTS[q])


def _response(seed: int, reward: float, step: int) -> StoredResponse:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    return StoredResponse(rng.integers(0, 128, n).astype(np.int32), rng.normal(-1, 0.3, n).astype(np.float32),
                          reward, step)


def _sample(q: int, r: StoredResponse) -> Sample:
    return Sample(PROMPTS[q], r.token_ids.tolist(), r.logprobs.tolist(), "stop")


def _rollouts(groups: dict[int, list[StoredResponse]]) -> StepRollouts:
    qgroups = [QuestionGroup(q, PROMPTS[q], "") for q in groups]
    return StepRollouts.unfiltered(qgroups, [[_sample(q, r) for r in rs] for q, rs in groups.items()],
                                   [[r.reward for r in rs] for rs in groups.values()])


def _fill(store: ResponseStore, steps: dict[int, dict[int, list[float]]]) -> dict[int, list[StoredResponse]]:
    """Run `steps` {step: {qid: rewards}} through the store as the trainer does (stored_outcomes, then expire);
    returns every response generated, per question, in the order generated."""
    made: dict[int, list[StoredResponse]] = {}
    for step, groups in steps.items():
        gen = {q: [_response(1000 * step + 10 * q + j, x, step) for j, x in enumerate(rs)] for q, rs in groups.items()}
        for q, rs in gen.items():
            made.setdefault(q, []).extend(rs)
        store.update(stored_outcomes(_rollouts(gen), step))
        store.expire(step)
        held = [r for q in store.state_dict()["arrays"]["qids"].tolist() for r in store.responses(q)]
        assert store.stats() == {"responses/questions": store.num_questions, "responses/stored": len(held),
                                 "responses/stored_tokens": sum(r.token_ids.shape[0] for r in held)}
    return made


def _same(a: StoredResponse, b: StoredResponse) -> bool:
    return (np.array_equal(a.token_ids, b.token_ids) and a.logprobs.tobytes() == b.logprobs.tobytes()
            and a.reward == b.reward)


def test_ingroup_gains_the_newest_r_responses_failures_too_or_successes_only():
    history = {1: {3: [1, 0, 0, 1]}, 2: {3: [0, 0, 1, 0], 4: [0, 0, 0, 0]}}
    for failures in (True, False):
        store = ResponseStore(ResponseReplay(per_question=3, failures=failures))
        made = _fill(store, history)
        # newest first: step 2's responses in generated order, then step 1's
        newest = [r for r in made[3][4:] + made[3][:4] if failures or r.reward == 1.0]
        rollouts = with_stored_responses(store, _rollouts({3: [_response(9, 0.0, 3)] * 4, 4: [_response(8, 1.0, 3)] * 4,
                                                           5: [_response(7, 0.0, 3)] * 4}))
        gained = {g.qid: s[4:] for g, s in zip(rollouts.groups, rollouts.samples, strict=True)}
        want = newest[:3]
        assert len(gained[3]) == len(want) and all(s.is_replay for s in gained[3])
        for s, r in zip(gained[3], want, strict=True):
            assert s.response_ids == r.token_ids.tolist() and s.logprobs == r.logprobs.tolist()
            assert s.prompt_ids == PROMPTS[3] and s.finish_reason == "replay"
        assert rollouts.rewards[0][4:] == [r.reward for r in want]
        assert len(gained[4]) == (3 if failures else 0) and gained[5] == []  # q 5 never seen
        assert rollouts.graded_samples[0] == rollouts.samples[0][:4]  # the graded groups stay the generated ones


def test_rescue_fires_only_on_all_fail_groups_with_the_newest_success():
    store = ResponseStore(ResponseReplay(per_question=1, failures=False, rescue_only=True))
    made = _fill(store, {1: {3: [1, 0, 1, 0], 4: [1, 0, 0, 0]}, 2: {3: [0, 1, 0, 0], 4: [0, 0, 0, 0]}})
    assert store.num_responses == 2  # one success per question, no failure stored
    rollouts = with_stored_responses(store, _rollouts({
        3: [_response(1, 0.0, 3)] * 4,  # all fail: gains q 3's newest success (step 2's)
        4: [_response(2, 0.0, 3)] * 3 + [_response(3, 1.0, 3)],  # a success: unchanged
        6: [_response(4, 0.0, 3)] * 4}))  # all fail, nothing stored: unchanged
    assert [len(s) for s in rollouts.samples] == [5, 4, 4]
    assert _same(_response_of(rollouts.samples[0][4], 1.0), made[3][5]) and rollouts.rewards[0] == [0, 0, 0, 0, 1.0]
    assert not any(s.is_replay for s in rollouts.samples[1] + rollouts.samples[2])


def _response_of(s: Sample, reward: float) -> StoredResponse:
    return StoredResponse(np.asarray(s.response_ids, np.int32), np.asarray(s.logprobs, np.float32), reward, 0)


def test_staleness_drops_responses_older_than_the_bound():
    """A = 2: after step t, responses collected before t + 1 - A are gone, so step t + 1 replays at most A steps
    old ones; a question left with none leaves the store."""
    store = ResponseStore(ResponseReplay(per_question=8, failures=True), max_age_steps=2)
    _fill(store, {1: {3: [1, 0], 4: [0, 1]}, 2: {3: [0, 0]}})
    assert sorted(r.step for r in store.responses(3)) == [1, 1, 2, 2] and store.num_questions == 2
    _fill(store, {3: {5: [1]}})  # after step 3: step 1's responses are 2 steps old for step 4: dropped
    assert [r.step for r in store.responses(3)] == [2, 2] and store.responses(4) == [] and store.num_questions == 2
    _fill(store, {4: {}})
    assert store.responses(3) == [] and [r.step for r in store.responses(5)] == [3]
    unbounded = ResponseStore(ResponseReplay(per_question=8, failures=True))
    _fill(unbounded, {1: {3: [1, 0]}, 9: {4: [0]}})
    assert len(unbounded.responses(3)) == 2


def _states_equal(a: dict, b: dict) -> bool:
    return a["meta"] == b["meta"] and a["arrays"].keys() == b["arrays"].keys() and all(
        a["arrays"][k].dtype == b["arrays"][k].dtype and a["arrays"][k].tobytes() == b["arrays"][k].tobytes()
        for k in a["arrays"])


def _filled_store(per_question: int = 3) -> ResponseStore:
    store = ResponseStore(ResponseReplay(per_question=per_question, failures=True), max_age_steps=5)
    _fill(store, {s: {q: [float((q + s + j) % 3 == 0) for j in range(4)] for q in range(s, 12, 2)}
                  for s in range(1, 5)})
    return store


def test_state_round_trip_is_bitwise_and_reshards_by_owner(monkeypatch):
    store = _filled_store()
    state = store.state_dict()
    again = ResponseStore(store.replay, max_age_steps=5)
    again.load_state_dicts([state])
    assert _states_equal(again.state_dict(), state)
    assert again.expire(7) == store.expire(7) > 0 and _states_equal(again.state_dict(), store.state_dict())
    # a run at DP=2 keeps the questions each rank owns: together all of them, none twice
    held = []
    for rank in (0, 1):
        shard = ResponseStore(store.replay, max_age_steps=5)
        shard.dp_rank, shard.dp_size = rank, 2
        shard.load_state_dicts([store.state_dict()])
        assert all(shard.owns(q) for q in shard.state_dict()["arrays"]["qids"].tolist())
        held.append(set(shard.state_dict()["arrays"]["qids"].tolist()))
    assert not held[0] & held[1] and held[0] | held[1] == set(store.state_dict()["arrays"]["qids"].tolist())
    assert held[0] and held[1]


def test_pool_file_round_trip(tmp_path):
    store = _filled_store()
    path = tmp_path / "pool.safetensors"
    export_store(store, path, is_writer=True, step=4, **IDENTITY)
    fresh = ResponseStore(ResponseReplay(per_question=2, failures=False), max_age_steps=5)
    import_store(fresh, path, **IDENTITY)
    saved = store.state_dict()["arrays"]
    for q in saved["qids"].tolist():  # the new run's rule applies: successes only, newest 2, collected at step 0
        want = [r for r in store.responses(q) if r.reward == 1.0][:2]
        got = fresh.responses(q)
        assert len(got) == len(want) and all(_same(g, w) and g.step == 0 for g, w in zip(got, want, strict=True))
    same_rule = ResponseStore(store.replay)
    import_store(same_rule, path, **IDENTITY)
    loaded = same_rule.state_dict()["arrays"]  # bitwise the written store, every step now 0
    assert all(loaded[k].tobytes() == saved[k].tobytes() for k in saved if k != "steps")
    assert not loaded["steps"].any() and saved["steps"].all()


def _rewrite_header(path, change) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    pool = json.loads(header["__metadata__"]["pool_file"])
    change(pool)
    header["__metadata__"]["pool_file"] = json.dumps(pool)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("damage, reason", [
    ("flip", "corrupt"), ("truncate", "not a readable pool file"), ("not_pool", "not a pool file"),
    ("newer", "format version"), ("vocab", "another vocabulary"), ("tokenizer", "another vocabulary"),
    ("questions", "other training questions"), ("missing_question", "lacks"), ("missing_file", "cannot read"),
])
def test_a_bad_pool_file_is_refused_with_the_reason(tmp_path, damage, reason):
    path = tmp_path / "pool.safetensors"
    write_pool_file(path, _filled_store().state_dict(), step=4, **IDENTITY)
    identity = dict(IDENTITY)
    if damage == "flip":  # a byte of the token ids (the data section ends with the arrays)
        data = bytearray(path.read_bytes())
        data[-40] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "not_pool":
        _rewrite_header(path, lambda h: h.update(format="something_else"))
    elif damage == "newer":
        _rewrite_header(path, lambda h: h.update(format_version=99))
    elif damage == "vocab":
        identity["vocab_size"] = 256
    elif damage == "tokenizer":
        identity["tokenizer"] = "tok-b"
    elif damage == "questions":
        identity["prompt_ids"] = lambda q: [*PROMPTS[q], 1]
    elif damage == "missing_question":
        identity["prompt_ids"] = lambda q: PROMPTS[q] if q < 5 else {}[q]
    else:
        path = tmp_path / "absent.safetensors"
    with pytest.raises(PoolFileError, match=reason):
        read_pool_file(path, **identity)


def test_the_response_store_keys_are_refused_by_variants_that_do_not_read_them():
    from exgrpo_megatron.algo.registry import build_algorithm

    def errors(*overrides: str) -> list[str]:
        cfg = load_config("demo_cpu", list(overrides))
        algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
        return [e.split(":", 1)[0] for e in response_store_key_errors(
            cfg.experience, cfg.algo.name, algorithm.experience_keys, algorithm.uses_pool)]

    assert errors("algo.name=grpo", "experience.ingroup_size=4", "experience.max_age_steps=3") == [
        "experience.ingroup_size", "experience.max_age_steps"]
    assert errors("algo.name=exgrpo", "experience.pool_file_out=x", "experience.max_age_steps=3") == [
        "experience.pool_file_out"]
    assert errors("algo.name=rescue_replay", "experience.ingroup_failures=false", "experience.pool_file_in=x") == [
        "experience.ingroup_failures"]
    assert errors("algo.name=ingroup_replay", "experience.ingroup_size=4", "experience.ingroup_failures=false",
                  "experience.max_age_steps=96", "experience.pool_file_in=a", "experience.pool_file_out=b") == []


def test_the_replay_variants_cap_is_their_own_setting_two_by_default():
    """algo.settings.replay_tis_cap: 2 unless set, and the start-up block shows the value in effect; 0 is refused
    (no hidden default); the former flat name algo.replay_tis_cap maps to it (config/aliases.py)."""
    from exgrpo_megatron.algo.registry import build_algorithm, settings_in_effect
    from exgrpo_megatron.config.validate import ConfigError

    def build(*overrides: str):
        cfg = load_config("demo_cpu", list(overrides))
        return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length), cfg.algo

    for name in ("ingroup_replay", "rescue_replay"):
        for overrides, cap in (((), 2.0), (("algo.settings.replay_tis_cap=3",), 3.0),
                               (("algo.replay_tis_cap=3",), 3.0)):
            algorithm, algo = build(f"algo.name={name}", *overrides)
            assert algorithm.replay_term.cap == cap and settings_in_effect(algo) == {"replay_tis_cap": cap}
        with pytest.raises(ConfigError) as err:
            build(f"algo.name={name}", "algo.settings.replay_tis_cap=0")
        assert [e.split(":", 1)[0] for e in err.value.errors] == ["algo.settings.replay_tis_cap"]
    with pytest.raises(ConfigError) as err:  # ExGRPO's setting of that name (0, off, by default) refuses f(w) with it
        build("algo.name=exgrpo", "algo.settings.replay_tis_cap=3")
    assert [e.split(":", 1)[0] for e in err.value.errors] == ["algo.settings.replay_tis_cap"]
