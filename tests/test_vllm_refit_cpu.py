"""CPU-testable parts of the vLLM refit: TP gather / PP broadcast of full weights, bucketing, lm_head.

TP=2 full tensors must equal the TP=1 weights bit for bit (the builder's CPU initialisation is
TP-invariant); PP=2 stages loaded with the TP=1 weights must stream the same named tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from exgrpo_megatron.rollout.refit import plan_buckets
from tests.helpers.multirank import run_on_ranks

BUCKET_BYTES = 16 * 1024

def _build(tp: int, pp: int, tied: bool):
    from exgrpo_megatron.config.schema import ModelConfig, ParallelConfig
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model

    init_distributed(tp, pp, seed=5)
    cfg = ModelConfig(vocab_size=128, make_vocab_size_divisible_by=64, num_layers=2, hidden_size=64,
                      ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, tie_word_embeddings=tied)
    return build_gpt_model(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)), cfg


def _stream(model, cfg) -> dict:
    from exgrpo_megatron.rollout.refit import iter_full_param_buckets, iter_hf_weight_buckets

    buckets = list(iter_full_param_buckets([model], BUCKET_BYTES))
    hf_pairs = [pair for b in iter_hf_weight_buckets([model], cfg, BUCKET_BYTES) for pair in b]  # convert.hf_mapping
    hf = dict(hf_pairs)
    return {
        "names": [n for b in buckets for n, _ in b],
        "tensors": {n: t.clone() for b in buckets for n, t in b},
        "bucket_bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets],
        "hf_names": [name for name, _ in hf_pairs],
        "lm_head_is_embedding": torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]),
        "lm_head_rows": hf["lm_head.weight"].shape[0],
    }


def reference_tp1() -> dict:
    from exgrpo_megatron.model.param_layout import named_global_params

    model, cfg = _build(1, 1, tied=False)
    params = named_global_params([model], tied_copy=False)
    out: dict[str, Any] = {"untied": _stream(model, cfg), "params": {n: p.detach().clone() for n, p in params}}
    out["param_order"] = [n for n, _ in model.named_parameters()]
    return out


def two_rank_layouts(tp1_params: dict) -> dict:
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.model.param_layout import named_global_params

    model, cfg = _build(2, 1, tied=False)
    out = {"tp2": _stream(model, cfg)}
    ps.destroy_model_parallel()
    model, cfg = _build(1, 2, tied=False)
    with torch.no_grad():
        for name, param in named_global_params([model], tied_copy=False):
            param.copy_(tp1_params[name])
    out["pp2"] = _stream(model, cfg)
    ps.destroy_model_parallel()
    model, cfg = _build(1, 2, tied=True)
    out["pp2_tied"] = _stream(model, cfg)
    return out


def test_plan_buckets_sizes_order_and_coverage():
    sizes = [5, 30, 7, 7, 7, 100, 1, 2]
    buckets = plan_buckets(sizes, 20)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))  # every tensor once, stable order
    assert all(sum(sizes[i] for i in b) >= 20 for b in buckets[:-1])
    assert buckets == [[0, 1], [2, 3, 4], [5], [6, 7]]
    keyed = plan_buckets([10, 10, 10], 100, keys=["fp32", "fp32", "bf16"])
    assert keyed == [[0, 1], [2]]


def test_full_weights_tp2_pp2_equal_tp1_and_lm_head_for_tied():
    ref = run_on_ranks(reference_tp1, world_size=1)[0]
    ranks = run_on_ranks(two_rank_layouts, world_size=2, args=(ref["params"],))
    untied = ref["untied"]
    # TP=1 streams exactly the model's parameters, in named_parameters() order.
    assert untied["names"] == ref["param_order"]
    for name, t in untied["tensors"].items():
        assert torch.equal(t, ref["params"][name])
    for layout in ("tp2", "pp2"):
        for rank in ranks:
            got = rank[layout]
            assert sorted(got["names"]) == sorted(untied["names"]) and len(set(got["names"])) == len(got["names"])
            for name, t in got["tensors"].items():
                assert torch.equal(t, untied["tensors"][name]), (layout, name)
    assert ranks[0]["tp2"]["names"] == untied["names"]  # TP gather keeps the order
    # buckets reach the threshold except the last of each stage (PP=2: two stages)
    for layout, n_stages in (("tp2", 1), ("pp2", 2)):
        sizes = ranks[0][layout]["bucket_bytes"]
        assert sum(s < BUCKET_BYTES for s in sizes) <= n_stages, (layout, sizes)
    expected_hf = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{s}" for i in range(2) for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            *(f"self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")))}
    assert sorted(untied["hf_names"]) == sorted(expected_hf)  # untied: lm_head is the real output layer
    for rank in ranks:
        tied = rank["pp2_tied"]
        assert "output_layer.weight" not in tied["names"]  # the last stage's copy is skipped
        assert sorted(tied["hf_names"]) == sorted(expected_hf)  # lm_head exactly once
        assert tied["lm_head_is_embedding"] and tied["lm_head_rows"] == 128


def test_vllm_finish_reason_mapping_and_lazy_import():
    import sys

    import exgrpo_megatron.rollout  # noqa: F401 - the package must not pull in vLLM
    from exgrpo_megatron.rollout.vllm_engine import finish_reason_from_vllm

    assert "vllm" not in sys.modules
    assert finish_reason_from_vllm("length", None) == "length"
    assert finish_reason_from_vllm("stop", None) == "eos"
    assert finish_reason_from_vllm("stop", 7) == "stop"
    assert finish_reason_from_vllm("stop", "</answer>") == "stop"


class _RecordingLLM:
    """Stands in for vLLM's `LLM` where the CPU build cannot run the call under test (sleep mode is CUDA-only):
    records the calls the engine's sleep/wake/refit bookkeeping makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append("wake")

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        list(kwargs["weights_iterator"])
        self.calls.append(method)

    def reset_prefix_cache(self) -> None:
        pass


def test_sleep_level_2_refits_on_the_next_generation_even_when_the_weights_did_not_change(monkeypatch):
    """Level 2 discards vLLM's weights: waking must not generate from them unrefitted (e.g. validation before any
    update, or a step whose updates were all skipped); level 1 keeps them, so no refit without a change."""
    from exgrpo_megatron.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "iter_hf_weight_buckets", lambda *a: iter(()))
    for level, refits in ((1, []), (2, ["reload_weights"])):
        engine = vllm_engine.VLLMRolloutEngine.__new__(vllm_engine.VLLMRolloutEngine)
        engine.llm, engine.can_sleep, engine.sleep_level, engine._asleep = _RecordingLLM(), True, level, False
        engine.model_chunks, engine.model_cfg, engine.bucket_bytes = [], None, 1
        engine.weights_version, engine.refit_seconds_total = (lambda: 3), 0.0
        engine.update_weights()  # the refit at construction
        engine.llm.calls.clear()
        engine.sleep()
        engine.wake()
        engine.refit_if_stale()  # what generate() does first
        assert engine.llm.calls == [f"sleep{level}", "wake", *refits]
