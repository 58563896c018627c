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
from tests.vllm.engines import LOGPROB_TOL

BF16_MEAN_TOL, BF16_MAX_TOL = 0.02, 0.25  # |logp_vllm - logp_trainer| per token; bf16 keeps 8 mantissa bits


def refit_case(tp: int, pp: int, hf_dir: str, dtype: str = "fp32", family: str = "qwen2") -> dict:
    import torch

    from exgrpo_megatron.distributed.threads import torch_threads
    from tests.vllm.engines import EnginePair, perturb_, tiny_model_config

    case = EnginePair(tp, pp, hf_dir, tiny_model_config(params_dtype=dtype, family=family))
    wanted = torch.get_num_threads() + 1
    with torch_threads(wanted):  # vLLM built: how the policy's passes get trainer.train_threads
        train_threads_applied = torch.get_num_threads() == wanted
    before = case.greedy(case.vllm)
    perturb_(case.policy.modules[0], seed=11)  # an in-place change, then the one signal: weights changed
    case.policy.mark_weights_changed()
    case.vllm.wake()
    v_greedy, m_greedy = case.greedy(case.vllm), case.greedy(case.megatron)
    abs_diffs, n_tokens = case.sampled_logprob_diffs()
    case.vllm.sleep()
    every = torch.cat(abs_diffs)
    return {"before": before, "vllm_greedy": v_greedy, "megatron_greedy": m_greedy,
            "max_logprob_diff": max(float(d.max()) for d in abs_diffs),
            "mean_logprob_diff": float(every.mean()), "mult_prob_error": float(every.exp().mean()),
            "param_dtype": str(next(case.policy.modules[0].parameters()).dtype),
            "n_tokens": n_tokens, "can_sleep": case.vllm.can_sleep, "train_threads_applied": train_threads_applied}


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
