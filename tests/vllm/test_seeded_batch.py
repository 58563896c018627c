"""Seeded sampling over a batch whose prompts exceed vLLM's per-step token budget (2,048 by default), as in
evaluate.py's 64-prompt calls: vLLM chunks such prefills and, for a discarded chunk's sample, rewinds the
request's generator, which the CPU build cannot do ("CPU Generator does not use offset": the engine crashed
mid-generate before rollout/vllm_engine.scheduler_kwargs). Every request returns its n samples, and the
same request seeds give the same samples."""

from __future__ import annotations

from tests.helpers.multirank import run_on_ranks

N_PROMPTS = 48
PROMPT_CHARS = 60  # 48 x 60 = 2,880 prompt tokens > 2,048


def seeded_batch_case(hf_dir: str) -> dict:
    from exgrpo_megatron.config.schema import DataConfig, RootConfig, TrainerConfig
    from exgrpo_megatron.data.tokenizer import CharTokenizer
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.rollout.factory import build_rollout_engine
    from exgrpo_megatron.rollout.types import SamplingParams
    from tests.vllm.engines import TEST_VLLM, tiny_model_config

    init_distributed(1, 1, seed=3)
    cfg = RootConfig(model=tiny_model_config(), trainer=TrainerConfig(total_steps=1, train_batch_size=1,
                                                                      ppo_mini_batch_size=1),
                     data=DataConfig(tokenizer="char", max_prompt_length=64, max_response_length=24))
    policy = Policy(cfg)
    tok = CharTokenizer()
    engine = build_rollout_engine("vllm", policy.modules[0], cfg.model, tok, vllm=TEST_VLLM, hf_dir=hf_dir,
                                  seed=0, max_model_len=96, max_batch_sequences=64,
                                  weights_version=lambda: policy.weights_version)
    prompts = [tok.encode((f"{i} + {i} = ? " * 8)[:PROMPT_CHARS]) for i in range(N_PROMPTS)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    runs = [[[s.response_ids for s in group] for group in engine.generate(prompts, 2, params)] for _ in range(2)]
    return {"prompt_tokens": sum(len(p) for p in prompts), "runs": runs}


def test_seeded_sampling_over_the_token_budget(tiny_hf_dir):
    result = run_on_ranks(seeded_batch_case, world_size=1, args=(tiny_hf_dir,))[0]
    assert result["prompt_tokens"] > 2048
    first, second = result["runs"]
    assert len(first) == N_PROMPTS and all(len(group) == 2 and all(group) for group in first)
    assert first == second  # per-request seeds: the same samples again
