"""Qwen3 (QK-norm, head dim != hidden / heads) in our rollout engine: a checkpoint converted from transformers'
own Qwen3ForCausalLM (small, random-initialised, offline) generates transformers' greedy tokens through the
megatron KV-cache engine (rollout/megatron_engine.py over rollout/kv_decode.py), and the log-prob it reports for
each token is transformers' teacher-forced one, at TP=1, TP=2 and PP=2 (2 gloo ranks). Training with Qwen3 is
checked layout by layout in tests/test_parallel_invariance.py, conversion in tests/test_convert.py."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.hf_families import make_hf_model
from tests.helpers.multirank import run_on_ranks

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
PROMPTS = [[5, 17, 42, 99, 3], [7, 8], [150, 2, 33, 61, 12, 190, 4, 77]]  # uneven: left padding in one batch
NEW_TOKENS = 12
LOGPROB_TOL = 1e-4


def engine_greedy(ckpt: str) -> dict:
    """{layout: (response ids per prompt, log-probs per prompt, decode path)} on this rank's last stage."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.config.schema import ParallelConfig
    from exgrpo_megatron.convert.hf_config import load_model_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    out = {}
    for tp, pp in LAYOUTS:
        init_distributed(tp, pp, seed=1)
        cfg = load_model_config(os.path.join(ckpt, "model_config.yaml"))
        cfg.params_dtype, cfg.layer_spec = "fp32", "local"
        model = build_gpt_model(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(ckpt, "model"))
        model.load_state_dict(loaded["model"])
        engine = MegatronRolloutEngine(model, vocab_size=cfg.vocab_size, decode_impl="kv_cache", max_batch_sequences=8)
        groups = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=NEW_TOKENS, top_k=1, seed=1))
        out[(tp, pp)] = ([g[0].response_ids for g in groups], [g[0].logprobs for g in groups],
                         engine.last_stats["kv_cache"])
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict:
    from exgrpo_megatron.convert.hf_to_megatron import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("qwen3")
    hf = make_hf_model("qwen3", str(root / "hf"))
    convert_hf_to_megatron(str(root / "hf"), str(root / "mg"), dtype="fp32", progress=False)
    reference = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            logp = torch.log_softmax(hf(seq).logits[0, :-1].double(), dim=-1)
        response = seq[0, len(prompt):]
        reference.append((response.tolist(), logp[len(prompt) - 1:].gather(-1, response[:, None])[:, 0].tolist()))
    return {"reference": reference, "ranks": run_on_ranks(engine_greedy, 2, args=(str(root / "mg"),))}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_kv_cache_engine_generates_transformers_greedy_tokens_and_logprobs(qwen3, layout):
    ref_tokens = [tokens for tokens, _ in qwen3["reference"]]
    assert len({tuple(t) for t in ref_tokens}) == len(PROMPTS)  # distinct continuations: a real comparison
    for rank in qwen3["ranks"]:  # both ranks of every layout hold the sampled tokens
        tokens, logprobs, kv_cache = rank[layout]
        assert kv_cache == 1.0  # the KV-cache path ran, not megatron's fallback
        assert tokens == ref_tokens
        for got, (_, ref) in zip(logprobs, qwen3["reference"], strict=True):
            assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= LOGPROB_TOL
