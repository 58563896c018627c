"""Refit: after the policy's weights change, vLLM (built by the production factory, fp32, CPU build)
generates from the new weights: greedy tokens equal the megatron engine's, and the log-probs vLLM reports
for its sampled tokens equal the policy's recomputed ones (the trainer's old log-probs) to <= 1e-4.
At TP=1, TP=2 (external_launcher, 2 gloo ranks) and PP=2, for Qwen2 and for Qwen3 (QK-norm: vLLM's own Qwen3 model
loads the q_norm / k_norm the refit streams). In bf16 (the policy's parameters and so vLLM's, the
CPU's best precision for a large model): the refit reaches vLLM, and its log-probs agree with the bf16 trainer's
to bf16 rounding (mean and max bounds below, and the mismatch ratio the trainer logs)."""

from __future__ import annotations

import pytest

from tests.helpers.multirank import run_on_ranks

LOGPROB_TOL = 1e-4
BF16_MEAN_TOL, BF16_MAX_TOL = 0.02, 0.25  # |logp_vllm - logp_trainer| per token; bf16 keeps 8 mantissa bits
PROMPTS = ["12+3=", "What is 7*8?", "<think>", "a"]


def refit_case(tp: int, pp: int, hf_dir: str, dtype: str = "fp32", family: str = "qwen2") -> dict:
    import torch

    from exgrpo_megatron.config.schema import DataConfig, ParallelConfig, RootConfig, TrainerConfig
    from exgrpo_megatron.data.tokenizer import CharTokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.distributed.threads import torch_threads
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import token_stats
    from exgrpo_megatron.rollout.factory import build_rollout_engine
    from exgrpo_megatron.rollout.types import SamplingParams
    from tests.vllm.engines import TEST_VLLM, perturb_, tiny_model_config

    init_distributed(tp, pp, seed=3)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cfg = RootConfig(model=tiny_model_config(params_dtype=dtype, family=family), parallel=parallel,
                     trainer=TrainerConfig(micro_batch_max_tokens=256, total_steps=1, train_batch_size=1,
                                           ppo_mini_batch_size=1),
                     data=DataConfig(tokenizer="char", max_prompt_length=32, max_response_length=24))
    policy = Policy(cfg)
    tok = CharTokenizer()
    common = dict(vllm=TEST_VLLM, hf_dir=hf_dir, seed=0, max_model_len=96, max_batch_sequences=16)
    vllm = build_rollout_engine("vllm", policy.modules[0], cfg.model, tok,
                                weights_version=lambda: policy.weights_version, **common)
    wanted = torch.get_num_threads() + 1
    with torch_threads(wanted):  # how the policy's passes get trainer.train_threads
        train_threads_applied = torch.get_num_threads() == wanted
    megatron = build_rollout_engine("megatron", policy.modules[0], cfg.model, tok, **common)
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1, seed=1)
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, seed=2)
    before = [g[0].response_ids for g in vllm.generate(prompts, 1, greedy)]

    perturb_(policy.modules[0], seed=11)  # an in-place change, then the one signal: weights changed
    policy.mark_weights_changed()
    vllm.wake()
    v_greedy = [g[0].response_ids for g in vllm.generate(prompts, 1, greedy)]
    m_greedy = [g[0].response_ids for g in megatron.generate(prompts, 1, greedy)]
    samples = [s for g in vllm.generate(prompts, 2, sampled) for s in g]
    vllm.sleep()
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ref = token_stats(policy, seqs, [len(s.prompt_ids) for s in samples], site="test", temperature=1.0,
                      with_entropy=False, max_tokens=256).logprobs
    abs_diffs = [(torch.tensor(s.logprobs, dtype=torch.float64) - r.double()).abs() for s, r in zip(samples, ref,
                                                                                                      strict=True)]
    diffs = [float(d.max()) for d in abs_diffs]
    every = torch.cat(abs_diffs)
    return {"before": before, "vllm_greedy": v_greedy, "megatron_greedy": m_greedy, "max_logprob_diff": max(diffs),
            "mean_logprob_diff": float(every.mean()), "mult_prob_error": float(every.exp().mean()),
            "param_dtype": str(next(policy.modules[0].parameters()).dtype),
            "n_tokens": sum(len(s.response_ids) for s in samples), "can_sleep": vllm.can_sleep,
            "train_threads_applied": train_threads_applied}


def _check(result: dict) -> None:
    assert result["vllm_greedy"] == result["megatron_greedy"]
    assert result["vllm_greedy"] != result["before"], "the weight change did not change vLLM's greedy output"
    print("refit:", {k: result[k] for k in ("max_logprob_diff", "n_tokens")})
    assert result["n_tokens"] > 0
    assert result["max_logprob_diff"] <= LOGPROB_TOL, result["max_logprob_diff"]


def test_refit_tp1(tiny_hf_dir):
    result = run_on_ranks(refit_case, world_size=1, args=(1, 1, tiny_hf_dir))[0]
    _check(result)
    assert result["can_sleep"] is False  # the CPU platform: built without sleep mode, sleep/wake no-ops
    # vLLM's CPU worker disables torch.set_num_threads; the engine restores it for the policy's passes
    assert result["train_threads_applied"]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_refit_two_ranks(tiny_hf_dir, tp, pp):
    results = run_on_ranks(refit_case, world_size=2, args=(tp, pp, tiny_hf_dir))
    for result in results:
        _check(result)
    assert results[0]["vllm_greedy"] == results[1]["vllm_greedy"]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_refit_qwen3(tiny_qwen3_hf_dir, tp):
    results = run_on_ranks(refit_case, world_size=tp, args=(tp, 1, tiny_qwen3_hf_dir, "fp32", "qwen3"))
    for result in results:
        _check(result)


def test_refit_bf16_tp1(tiny_hf_dir):
    result = run_on_ranks(refit_case, world_size=1, args=(1, 1, tiny_hf_dir, "bf16"))[0]
    print("refit bf16:", {k: result[k] for k in ("max_logprob_diff", "mean_logprob_diff", "mult_prob_error")})
    assert result["param_dtype"] == "torch.bfloat16" and result["n_tokens"] > 0
    assert result["vllm_greedy"] != result["before"], "the weight change did not reach bf16 vLLM"
    assert result["mean_logprob_diff"] <= BF16_MEAN_TOL and result["max_logprob_diff"] <= BF16_MAX_TOL, result
    assert result["mult_prob_error"] < 1.05
