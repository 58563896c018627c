"""Every numeric key has a declared domain; values outside it and broken orderings exit 2 at start-up (and in
the dry run), missing paths at start-up (the dry run lists them), naming key, value and reason, before anything
is built."""

from __future__ import annotations

import dataclasses
import sys
import typing

import pytest

from exgrpo_megatron.config import schema
from exgrpo_megatron.config.domains import DOMAINS, ORDERINGS, Domain
from exgrpo_megatron.train import main as train_main

# the values that passed validation and the dry run before the domain checks, each with the reason expected
BAD_VALUES = [
    ("optim.lr=nan", "optim.lr: nan: must be a number, not NaN"),
    ("rollout.temperature=inf", "rollout.temperature: inf: must be finite"),
    ("optim.adam_beta1=1.5", "optim.adam_beta1: 1.5: must be in [0, 1)"),
    ("optim.adam_eps=0", "optim.adam_eps: 0.0: must be in (0, inf)"),
    ("optim.clip_grad=-1", "optim.clip_grad: -1.0: must be in [0, inf)"),
    ("optim.weight_decay=-0.5", "optim.weight_decay: -0.5: must be in [0, inf)"),
    ("optim.lr_warmup_steps=-3", "optim.lr_warmup_steps: -3: must be in [0, inf)"),
    ("optim.min_lr=0.01", "optim.min_lr: 0.01: must be <= optim.lr (0.0001)"),
    ("trainer.val_every=-1", "trainer.val_every: -1: must be in [0, inf)"),
    ("rollout.max_batch_sequences=0", "rollout.max_batch_sequences: 0: must be in [1, inf)"),
    ("rollout.top_k=0", "rollout.top_k: 0: must be in [1, inf) or -1"),
    ("trainer.sft_warm_start_steps=-1", "trainer.sft_warm_start_steps: -1: must be in [0, inf)"),
    ("rollout.val_temperature=-1", "rollout.val_temperature: -1.0: must be in [0, inf)"),
    ("rollout.vllm.refit_bucket_mb=0", "rollout.vllm.refit_bucket_mb: 0: must be in [1, inf)"),
    ("rollout.stop_check_every=0", "rollout.stop_check_every: 0: must be in [1, inf)"),
    ("rollout.cuda_graphs=true", "rollout.cuda_graphs: true needs CUDA"),  # this suite runs on CPU
    ("rollout.cuda_graphs=sometimes", "rollout.cuda_graphs: 'sometimes' is not one of auto, true, false"),
    ("rollout.decode_loop=sideways", "rollout.decode_loop: 'sideways'"),
]

MISSING_PATHS = [
    (["checkpoint.init_from=/nonexistent/ckpt"], "checkpoint.init_from: '/nonexistent/ckpt': does not exist"),
    (["checkpoint.resume=/nonexistent/run"], "checkpoint.resume: '/nonexistent/run': does not exist"),
    (["data.source=files", "data.train_files=[/nonexistent/train.jsonl]", "trainer.sft_warm_start_steps=0"],
     "data.train_files[0]: '/nonexistent/train.jsonl': does not exist"),
    (["model.hf_path=/nonexistent/hf"], "model.hf_path: '/nonexistent/hf': does not exist"),
]


def _run(args: list[str], capsys, dry_run: bool) -> tuple[int, str]:
    argv = ["--config-name", "demo_cpu", "optim.lr=1e-4", *args] + (["--dry-run"] if dry_run else [])
    code = train_main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry_run"])
@pytest.mark.parametrize("override,expected", BAD_VALUES, ids=[v[0] for v in BAD_VALUES])
def test_bad_value_exits_2_naming_key_value_and_reason(override, expected, dry_run, capsys):
    code, err = _run([override], capsys, dry_run)
    assert code == 2 and expected in err, err
    assert "torch.distributed" not in sys.modules or not _process_group_exists()


@pytest.mark.parametrize("overrides,expected", MISSING_PATHS, ids=[m[1].split(":")[0] for m in MISSING_PATHS])
def test_missing_path_exits_2_naming_key_value_and_reason(overrides, expected, capsys):
    code, err = _run(overrides, capsys, dry_run=False)
    assert code == 2 and expected in err, err


@pytest.mark.parametrize("overrides,expected", MISSING_PATHS, ids=[m[1].split(":")[0] for m in MISSING_PATHS])
def test_dry_run_plans_without_the_paths_and_names_them(overrides, expected, capsys):
    """The plan needs the model's shape (from the preset), not its weights or data: the dry run exits 0 and
    lists what a run would stop on."""
    code, err = _run(overrides, capsys, dry_run=True)
    assert code == 0 and f"dry run: a run would exit 2 on {expected}" in err, err


def test_path_of_the_wrong_kind_and_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    code, err = _run([f"model.hf_path={not_a_dir}", f"checkpoint.init_from={tmp_path}"], capsys, False)
    assert code == 2
    assert f"model.hf_path: '{not_a_dir}': is not a directory" in err
    assert f"checkpoint.init_from: '{tmp_path}': has no model" in err


def _process_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _numeric_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += _numeric_keys(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is not list and {int, float} & {hint, *typing.get_args(hint)}:
            keys.append(prefix + f.name)
    return keys


def test_every_numeric_key_of_the_schema_has_a_domain():
    numeric = _numeric_keys(schema.RootConfig)
    assert len(numeric) > 60
    assert sorted(set(numeric) - set(DOMAINS)) == []
    assert sorted(set(DOMAINS) - set(numeric)) == []
    for small, large in ORDERINGS:
        assert small in DOMAINS and large in DOMAINS


@pytest.mark.parametrize("domain,value,ok", [
    (Domain(lo=0, lo_open=True), 1e-300, True), (Domain(lo=0, lo_open=True), 0.0, False),
    (Domain(hi=1, hi_open=True), 1.0, False), (Domain(hi=1), 1.0, True),
    (Domain(lo=0, inf_ok=True), float("inf"), True), (Domain(lo=0), float("inf"), False),
    (Domain(lo=0, inf_ok=True), float("-inf"), False), (Domain(), float("nan"), False),
    (Domain(lo=1, extra=(-1,)), -1, True), (Domain(lo=1, extra=(-1,)), -2, False),
    (Domain(none_ok=True), None, True), (Domain(), None, False), (Domain(), True, False),
])
def test_domain_rules(domain, value, ok):
    assert (domain.problem(value) is None) is ok
