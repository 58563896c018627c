"""The trainer with LoRA adapters (tiny demo run, observed through a StepObserver): the base weights stay bitwise
unchanged while the adapters train; the engine generates with the adapters (the sampler's and the trainer's
log-probs agree at every step); a run stopped after its checkpoint and resumed continues bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.model.param_layout import is_adapter, named_global_params
from exgrpo_megatron.training.step_observer import StepObserver
from tests.helpers.multirank import run_on_ranks
from tests.test_trainer import _overrides

LORA = ("lora.rank=4", "lora.alpha=8", "optim.lr=1e-2", "optim.adam_eps=1e-8")  # Adam steps of ~lr: visible adapters
TOKENS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 20, 7, 33]])


class WeightWatch(StepObserver):
    """This rank's parameters (global names) when step 1 starts and when the last step finished."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.policy: Any = None
        self.first: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.logits = torch.empty(0)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in named_global_params(self.policy.modules, tied_copy=False)}

    def started(self, c: Any) -> None:
        self.policy = c.policy

    def step_started(self, step: int) -> None:
        if not self.first:
            self.first = self._snapshot()

    def step_finished(self, step: int, metrics: dict[str, Any]) -> None:
        if step == self.last_step:
            self.last = self._snapshot()
            with torch.no_grad():  # the adapted policy's logits of a fixed sequence (sdpa: causal without a mask)
                self.logits = self.policy.modules[0](TOKENS, torch.arange(TOKENS.shape[1]).unsqueeze(0), None)


def _train_watched(overrides: list[str], last_step: int) -> dict:
    from exgrpo_megatron.training.trainer import run_training

    cfg = load_config("demo_cpu", overrides)
    watch = WeightWatch(last_step)
    assert run_training(cfg, observers=[watch]) == 0
    logged = [json.loads(line) for line in (Path(cfg.logging.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"first": watch.first, "last": watch.last, "logged": logged,
            "logits": watch.logits[..., :cfg.model.vocab_size]}


def test_lora_run_trains_only_the_adapters_generates_with_them_and_resumes_bitwise(tmp_path):
    # the base: the supervised warm start's sealed cache entry, which the checkpoints name instead of copying
    base = ("trainer.sft_warm_start_steps=2", f"trainer.sft_cache_dir={tmp_path / 'sft'}")
    straight = run_on_ranks(_train_watched, 1, args=(_overrides(str(tmp_path / "a"), extra=(
        *LORA, *base, "trainer.total_steps=4")), 4))[0]
    first, last = straight["first"], straight["last"]
    assert first and set(first) == set(last)
    adapters = [n for n in first if is_adapter(n)]
    assert adapters and len(adapters) < len(first)
    for name in first:
        if name.endswith("lora_b"):  # B gets a gradient from the first update (A's is 0 until B is not)
            assert not torch.equal(first[name], last[name]), f"adapter {name} did not train"
        elif not is_adapter(name):
            assert torch.equal(first[name], last[name]), f"frozen {name} changed"
    assert any(not torch.equal(first[n], last[n]) for n in adapters if n.endswith("lora_a"))
    logged = straight["logged"]
    assert len(logged) == 4
    for row in logged:  # the engine runs the adapted policy: its log-probs are the trainer's
        assert 0.999 < row["mismatch/token_mult_prob_error"] < 1.001, (row["step"], row)

    # the HF export merges the adapters: transformers computes the adapted policy's logits
    from transformers import AutoModelForCausalLM

    from exgrpo_megatron.convert.megatron_to_hf import convert_megatron_to_hf

    convert_megatron_to_hf(str(tmp_path / "a" / "checkpoints"), str(tmp_path / "hf"), dtype="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(TOKENS).logits
    gap = (hf_logits - straight["logits"]).abs().max()
    assert gap < 1e-4, gap  # without the merge: 0.5

    # stopped after the step-2 checkpoint, then resumed to step 4: the same steps, the same adapters
    resumed_dir = str(tmp_path / "b")
    run_on_ranks(_train_watched, 1, args=(_overrides(resumed_dir, extra=(
        *LORA, *base, "trainer.total_steps=2", "checkpoint.save_every=2")), 2))
    saved = _saved_model_keys(tmp_path / "b" / "checkpoints" / "step_00000002")
    assert saved["adapters"] and not saved["base"], saved  # the adapters and their Adam state, no base weight
    assert saved["lora_base"]["path"].startswith(str(tmp_path / "sft"))
    resumed = run_on_ranks(_train_watched, 1, args=(_overrides(resumed_dir, extra=(
        *LORA, *base, "trainer.total_steps=4", "checkpoint.save_every=2")), 4))[0]
    for name, tensor in last.items():
        assert torch.equal(resumed["last"][name], tensor), name
    steps = {row["step"]: row for row in resumed["logged"]}
    for row in logged[2:]:
        assert steps[row["step"]]["reward/mean"] == row["reward/mean"]
        assert steps[row["step"]]["loss/policy"] == row["loss/policy"]

    # another base at the named path (re-sealed, so its own manifest verifies): the resume is refused, exit 2
    import subprocess
    import sys

    from exgrpo_megatron.checkpoint.integrity import write_weights_manifest

    base_dir = Path(saved["lora_base"]["path"])
    shard = max((base_dir / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    write_weights_manifest(base_dir)
    proc = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu",
                           *_overrides(resumed_dir, extra=(*LORA, *base, "trainer.total_steps=6"))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"trained on the base weights {base_dir}, which have changed since" in proc.stderr
    assert (tmp_path / "b" / "checkpoints" / "step_00000004").is_dir()  # refused, not moved aside


def _saved_model_keys(step_dir: Path) -> dict:
    from exgrpo_megatron.convert.dist_ckpt_io import DistCheckpointReader

    keys = [k for k in DistCheckpointReader(str(step_dir / "model")).metadata.state_dict_metadata
            if not k.startswith("optimizer")]
    root = json.loads((step_dir / "checkpoint.json").read_text())
    return {"adapters": [k for k in keys if is_adapter(k)], "base": [k for k in keys if not is_adapter(k)],
            "lora_base": root.get("lora_base")}


def _peft_dir_for_the_demo(out_dir: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory for the run's model (random A and B, written as the export writes them); returns
    the megatron adapters it stands for."""
    from exgrpo_megatron.convert.hf_mapping import megatron_shape
    from exgrpo_megatron.convert.peft_adapter import (
        adapted_weights,
        peft_adapter_config,
        peft_adapter_tensors,
        write_peft_adapter,
    )

    cfg = load_config("demo_cpu", overrides)
    rank = cfg.lora.rank
    g = torch.Generator().manual_seed(4)
    tensors, full = {}, {}
    for weight in adapted_weights(cfg.model, cfg.lora.targets):
        out, inp = megatron_shape(weight, cfg.model)
        a, b = torch.randn(rank, inp, generator=g), torch.randn(out, rank, generator=g) * 0.1
        full[weight.removesuffix("weight") + "lora_a"], full[weight.removesuffix("weight") + "lora_b"] = a, b
        tensors.update(peft_adapter_tensors(weight, a, b, cfg.model))
    write_peft_adapter(out_dir, tensors, peft_adapter_config(cfg.lora, cfg.lora.targets, None))
    return full


def test_lora_init_from_a_peft_adapter_starts_the_run_from_it(tmp_path):
    import subprocess
    import sys

    overrides = _overrides(str(tmp_path / "a"), extra=(*LORA, "trainer.total_steps=1"))
    want = _peft_dir_for_the_demo(str(tmp_path / "peft"), overrides)
    run = run_on_ranks(_train_watched, 1, args=([*overrides, f"lora.init_from={tmp_path / 'peft'}"], 1))[0]
    adapters = {n: t for n, t in run["first"].items() if is_adapter(n)}
    assert set(adapters) == set(want)
    for name, tensor in want.items():
        assert torch.equal(adapters[name], tensor), name
    # a rank the adapter does not have is refused at start-up, exit 2 naming the key
    refused = [*_overrides(str(tmp_path / "refused"), extra=(*LORA, "trainer.total_steps=1")), "lora.rank=8",
               "lora.alpha=16", f"lora.init_from={tmp_path / 'peft'}"]
    proc = subprocess.run([sys.executable, "-m", "exgrpo_megatron.train", "--config-name", "demo_cpu", *refused],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "lora.rank: 8: the adapter at" in proc.stderr, proc.stderr


def test_lora_generating_ahead_samples_from_the_adapted_policy(tmp_path):
    """The generator process (rollout.max_staleness=1) receives the adapted linears' merged weights: at step 1 (both
    at the initial weights, B non-zero from a PEFT adapter) its log-probs equal the trainer's."""
    overrides = _overrides(str(tmp_path / "a"), extra=(*LORA, "trainer.total_steps=2", "rollout.max_staleness=1",
                                                       "algo.fresh_is_cap=2.0"))
    _peft_dir_for_the_demo(str(tmp_path / "peft"), overrides)
    run = run_on_ranks(_train_watched, 1, args=([*overrides, f"lora.init_from={tmp_path / 'peft'}"], 2))[0]
    first = run["logged"][0]
    assert first["rollout/staleness"] == 0.0, first
    assert abs(first["mismatch/token_mult_prob_error"] - 1.0) < 1e-5, first["mismatch/token_mult_prob_error"]
    assert any(is_adapter(n) and not torch.equal(t, run["last"][n]) for n, t in run["first"].items())


def _save_full_model(overrides: list[str], out_dir: str) -> dict[str, torch.Tensor]:
    """A full fine-tuning policy's weights (perturbed from their init) as a sealed weights-only dir."""
    from exgrpo_megatron.checkpoint import model_config_to_yaml
    from exgrpo_megatron.checkpoint.weights import save_model_weights
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy
    from tests.helpers.gather import full_tensors, load_full_tensors

    cfg = load_config("demo_cpu", overrides)
    init_distributed(1, 1, seed=cfg.seed)
    policy = Policy(cfg)
    g = torch.Generator().manual_seed(6)
    full = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in sorted(full_tensors(policy.modules).items())}
    load_full_tensors(policy.modules, full)
    save_model_weights(out_dir, policy.modules, model_config_yaml=model_config_to_yaml(cfg.model))
    return full


def test_lora_from_a_base_checkpoint_starts_from_it_and_names_it(tmp_path):
    overrides = _overrides(str(tmp_path / "a"), extra=("trainer.total_steps=1", "checkpoint.save_every=1"))
    base = run_on_ranks(_save_full_model, 1, args=(overrides, str(tmp_path / "base")))[0]
    run = run_on_ranks(_train_watched, 1, args=([*overrides, *LORA, f"checkpoint.init_from={tmp_path / 'base'}"],
                                               1))[0]
    frozen = {n: t for n, t in run["first"].items() if not is_adapter(n)}
    assert set(frozen) == set(base)
    for name, tensor in base.items():
        assert torch.equal(frozen[name], tensor), name
    saved = _saved_model_keys(tmp_path / "a" / "checkpoints" / "step_00000001")
    assert saved["adapters"] and not saved["base"]
    assert saved["lora_base"]["path"] == str((tmp_path / "base").resolve())
