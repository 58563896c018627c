"""Our KV-cache engine generates with a Qwen3-MoE model (EP=1): every sampled token's log-prob equals the
teacher-forced log-prob of one plain causal forward of the same model (the routing of a token does not depend on
whether it was decoded one step at a time or in one pass)."""

from __future__ import annotations

import torch

from exgrpo_megatron.config.loader import load_config
from tests.helpers.multirank import run_on_ranks

VOCAB = 128


def generate_and_teacher_force() -> dict:
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model, causal_attention_mask
    from exgrpo_megatron.model.layout_init import initialise
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    cfg = load_config("demo_cpu", ["model=tiny_qwen3_moe", "model.params_dtype=fp32",
                                   "model.moe_token_dispatcher=allgather"])
    init_distributed(seed=cfg.seed)
    model = build_gpt_model(cfg.model, cfg.parallel)
    initialise([model], cfg.model, cfg.seed)
    engine = MegatronRolloutEngine(model, vocab_size=VOCAB, max_batch_sequences=8)
    prompts = [[5, 9, 17, 3], [40, 2], [7, 7, 7, 8, 9, 10]]
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3))
    diffs = []
    model.eval()
    for group in groups:
        for s in group:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                               attention_mask=causal_attention_mask(ids.shape[1], 1))
            logp = torch.log_softmax(logits[0, len(s.prompt_ids) - 1: -1, :VOCAB].double(), -1)
            ref = logp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
            diffs.append(float((ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max()))
    return {"impl": engine.decode_impl, "diffs": diffs, "lengths": [len(s.response_ids) for g in groups for s in g]}


def test_kv_cache_engine_generates_with_the_moe_model():
    out = run_on_ranks(generate_and_teacher_force, 1)[0]
    assert out["impl"] == "kv_cache" and len(out["diffs"]) == 6 and max(out["lengths"]) == 10
    assert max(out["diffs"]) <= 1e-5, out["diffs"]


def generate_at_ep(ep: int) -> list:
    """Two ranks (DP=2) generate different prompts, rank 0 more and longer ones, so the EP ranks run different
    numbers of forwards; the weights are the same at every layout."""
    import torch.distributed as dist

    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.rollout.megatron_engine import MegatronRolloutEngine
    from exgrpo_megatron.rollout.types import SamplingParams

    cfg = load_config("demo_cpu", ["model=tiny_qwen3_moe", "model.params_dtype=fp32",
                                   f"parallel.expert_model_parallel_size={ep}"])
    init_distributed(seed=cfg.seed, expert_model_parallel_size=ep)
    engine = MegatronRolloutEngine(Policy(cfg).modules[0], vocab_size=VOCAB, max_batch_sequences=4)
    prompts = [[[5, 9, 17, 3], [40, 2], [7, 7, 7, 8, 9, 10]], [[11, 12]]][dist.get_rank()]
    params = SamplingParams(max_new_tokens=16 if dist.get_rank() == 0 else 4, temperature=1.0, seed=3,
                            stop_token_ids=list(range(0, VOCAB, 8)))
    groups = engine.generate(prompts, 3, params)
    return [(s.response_ids, s.logprobs) for g in groups for s in g]


def test_the_engine_generates_at_ep2_as_at_ep1():
    """EP=2 (each rank holds half the experts; every forward is a round of the EP group, a finished rank joins with
    one-token forwards) samples the tokens EP=1 samples, their log-probs equal to 1e-5."""
    ref = run_on_ranks(generate_at_ep, 2, args=(1,))
    got = run_on_ranks(generate_at_ep, 2, args=(2,))
    assert [len(r) for r in got] == [9, 3]
    for r, g in zip(ref, got, strict=True):
        for (ids_r, lp_r), (ids_g, lp_g) in zip(r, g, strict=True):
            assert ids_g == ids_r
            assert max(abs(a - b) for a, b in zip(lp_g, lp_r, strict=True)) <= 1e-5
