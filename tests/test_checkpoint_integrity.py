"""Checkpoint integrity: every file kind of a checkpoint, truncated or with bytes flipped, is caught by
verification, named with file and reason, moved aside (never deleted), and resume falls back to the
newest checkpoint that verifies, with exactly its weights; ranks agree when only one rank's share of
the files is bad; retention never deletes because of an unverified checkpoint.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_checkpoint_integrity.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from exgrpo_megatron.checkpoint import layout as L
from exgrpo_megatron.checkpoint.integrity import my_share
from tests.checkpoint_worker import TINY, build_tiny_trainer, synthetic_pool_shard, train_step
from tests.helpers.multirank import run_on_ranks

# one representative of every kind of file a checkpoint holds (glob relative to the step dir)
FILE_KINDS = {
    "model shard": "model/*.distcp",
    "model metadata": "model/.metadata",
    "model common": "model/common.pt",
    "pool shard": "pool/shard_*.safetensors",
    "pool manifest": "pool/manifest.json",
    "rng tensors": "state/rng/rank_00000.safetensors",
    "rng scalars": "state/rng/rank_00000.json",
    "trainer state": "state/trainer_state.json",
    "scheduler state": "state/opt_param_scheduler.json",
    "model config": "model_config.yaml",
    "run config": "config.yaml",
    "root manifest": "checkpoint.json",
}


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # flip 16 bytes in the middle, size unchanged
        mid = len(data) // 2
        for i in range(max(mid - 8, 0), min(mid + 8, len(data))):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))


def _scheduler(optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    for group in optimizer.param_groups:  # what get_megatron_optimizer sets from OptimizerConfig.lr / min_lr
        group.setdefault("max_lr", 1e-2)
        group["min_lr"] = group.get("min_lr") or 0.0
    return OptimizerParamScheduler(optimizer, init_lr=1e-2, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=0,
                                   lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                   wd_incr_steps=100, wd_incr_style="constant")


def _save(run_dir: str, step: int, gpt, opt, sched, layout, keep_last: int = 5) -> Path:
    from exgrpo_megatron.checkpoint import model_config_to_yaml, save_checkpoint

    return save_checkpoint(run_dir, step, model_chunks=[gpt], optimizer=opt, opt_param_scheduler=sched,
                           pool_shard=synthetic_pool_shard(10, step + layout.dp_rank),
                           pool_shard_index=(layout.dp_rank, layout.dp_size), trainer_state={"step": step},
                           config_yaml="seed: 1\n", model_config_yaml=model_config_to_yaml(TINY), keep_last=keep_last)


def _weights(gpt) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}


def fallback_matrix(root: str, cases: list[tuple[str, str, str]]):
    """Save steps 1 and 2; for each (kind, glob, how): a copy of the run with step 2's file corrupted,
    then load_newest_verified -> which step loaded, whether the weights are step 1's, what was reported."""
    import torch.distributed as dist

    from exgrpo_megatron.checkpoint import CheckpointVerificationError, load_newest_verified

    layout, gpt, ddp, opt = build_tiny_trainer(tp=1, pp=1)
    sched = _scheduler(opt)
    pristine = Path(root) / "pristine"
    train_step(layout, ddp, opt, 0)
    _save(str(pristine), 1, gpt, opt, sched, layout)
    step1 = _weights(gpt)
    train_step(layout, ddp, opt, 1)
    _save(str(pristine), 2, gpt, opt, sched, layout)
    step2 = _weights(gpt)
    step2_dir = L.checkpoints_dir(pristine) / "step_00000002"
    names = sorted(json.loads((step2_dir / "checkpoint.json").read_text())["file_digests"])
    out = {"shares": {r: my_share(names, r, dist.get_world_size()) for r in range(dist.get_world_size())},
           "cases": []}
    for index, (kind, pattern, how) in enumerate(cases):
        run = Path(root) / f"case_{index}"
        if dist.get_rank() == 0:
            shutil.copytree(pristine, run)
            if pattern.startswith("@share:"):  # the first file that rank N verifies
                target = L.checkpoints_dir(run) / "step_00000002" / out["shares"][int(pattern[7:])][0]
            else:
                target = sorted((L.checkpoints_dir(run) / "step_00000002").glob(pattern))[0]
            _corrupt(target, how)
        dist.barrier()
        with torch.no_grad():
            for p in gpt.parameters():
                p.add_(1.0)
        loaded = load_newest_verified(run, "auto", model_chunks=[gpt], model_config=TINY, optimizer=opt,
                                      opt_param_scheduler=sched)
        rejected = loaded.rejected[0]
        ckpts = L.checkpoints_dir(run)
        out["cases"].append({
            "kind": kind, "how": how, "step": loaded.step,
            "weights_are_step1": all(torch.equal(p, step1[n]) for n, p in gpt.named_parameters()),
            "file": rejected.file, "reason": rejected.reason, "message": str(rejected),
            "moved": (ckpts / "rejected" / "step_00000002").is_dir(),
            "reason_file": (ckpts / "rejected" / "step_00000002.reason.txt").read_text()
            if (ckpts / "rejected" / "step_00000002.reason.txt").exists() else "",
            "step2_gone_from_namespace": not (ckpts / "step_00000002").exists(),
        })
        # an explicitly named checkpoint that fails is refused, not moved
        if index == 0:
            try:
                load_newest_verified(run, str(ckpts / "rejected" / "step_00000002"), model_chunks=[gpt],
                                     model_config=TINY, optimizer=opt)
                out["explicit"] = None
            except CheckpointVerificationError as err:
                out["explicit"] = str(err)
            out["explicit_not_moved"] = (ckpts / "rejected" / "step_00000002").is_dir()
    # the clean run loads step 2
    loaded = load_newest_verified(pristine, "auto", model_chunks=[gpt], model_config=TINY, optimizer=opt)
    out["clean"] = {"step": loaded.step, "rejected": len(loaded.rejected),
                    "weights_are_step2": all(torch.equal(p, step2[n]) for n, p in gpt.named_parameters())}
    return out


def _cases() -> list[tuple[str, str, str]]:
    return [(kind, pattern, how) for kind, pattern in FILE_KINDS.items() for how in ("truncate", "flip")]


def test_every_file_kind_truncated_or_flipped_falls_back_to_the_previous_checkpoint(tmp_path):
    (out,) = run_on_ranks(fallback_matrix, 1, args=(str(tmp_path), _cases()))
    assert out["clean"] == {"step": 2, "rejected": 0, "weights_are_step2": True}
    assert len(out["cases"]) == 2 * len(FILE_KINDS)
    for case in out["cases"]:
        label = f"{case['kind']} {case['how']}"
        assert case["step"] == 1 and case["weights_are_step1"], label
        assert case["moved"] and case["step2_gone_from_namespace"], label
        assert case["file"] in case["message"] and case["reason"] in case["reason_file"], label
        if case["kind"] == "root manifest":
            assert case["file"] == "checkpoint.json", label
        else:
            pattern = FILE_KINDS[case["kind"]]
            assert Path(case["file"]).match(pattern), label
            expected = "size" if case["how"] == "truncate" else "sha256 mismatch"
            assert expected in case["reason"], label
    assert "failed verification" in out["explicit"] and out["explicit_not_moved"]


def test_ranks_agree_when_only_one_rank_sees_the_bad_file(tmp_path):
    """DP=2: each rank verifies its share of the files (every other one); a bad file in rank 1's share,
    then in rank 0's: both ranks reject step 2, name the same file and load step 1."""
    cases = [("rank 1's file", "@share:1", "flip"), ("rank 0's file", "@share:0", "truncate")]
    results = run_on_ranks(fallback_matrix, 2, args=(str(tmp_path), cases))
    shares = results[0]["shares"]
    assert [c["file"] for c in results[0]["cases"]] == [shares[1][0], shares[0][0]]
    for r in results:
        assert [c["step"] for c in r["cases"]] == [1, 1]
        assert all(c["weights_are_step1"] for c in r["cases"])
        assert [c["file"] for c in r["cases"]] == [c["file"] for c in results[0]["cases"]]


def test_retention_never_deletes_because_of_an_unverified_checkpoint(tmp_path):
    ckpt_dir = L.checkpoints_dir(tmp_path)
    for step in (1, 2, 3, 4):
        d = ckpt_dir / L.step_dir_name(step)
        d.mkdir(parents=True)
        (d / L.ROOT_MANIFEST).write_text("{}")
    newest = ckpt_dir / L.step_dir_name(4)
    # only the newest is verified: with keep_last=2 nothing may go
    def paths(*steps):
        return {(ckpt_dir / L.step_dir_name(s)).resolve() for s in steps}

    assert L.apply_retention(ckpt_dir, 2, newest, verified=paths(4)) == []
    # 3 and 4 verified: 1 and 2 may go
    assert [p.name for p in L.apply_retention(ckpt_dir, 2, newest, verified=paths(3, 4))] == ["step_00000001",
                                                                                           "step_00000002"]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000003", "step_00000004"]
