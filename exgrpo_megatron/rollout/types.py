"""The rollout contract: sampling parameters, one sampled trajectory, and the engine protocol.

Every engine (megatron-core hand loop, vLLM) returns the same `Sample` objects, so the trainer,
grader and experience pool never see which engine produced them.

Log-prob contract (all engines): `Sample.logprobs[t] = log_softmax(logits_t / T)[response_ids[t]]`
under the temperature-scaled FULL distribution over the real vocabulary (ids < vocab_size; the
TP padding of megatron's vocabulary is masked out). top-p / top-k only restrict which token is
drawn; the returned log-prob is NOT renormalised over the nucleus, so it equals the trainer's
teacher-forced log-prob at the same temperature (PPO/GRPO ratio = 1 at the start of a step).
Greedy decoding (temperature == 0) returns log_softmax(logits) (T treated as 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["eos", "stop", "length", "replay"]

@dataclass(frozen=True)
class SamplingParams:
    """What to sample. `seed` is the call-level seed; per-request seeds refine it (see RolloutEngine)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: no top-k restriction
    stop_token_ids: list[int] = field(default_factory=list)  # finish_reason "stop"; the token is kept
    stop_strings: list[str] = field(default_factory=list)  # finish_reason "stop"; see engine docs
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Sample:
    """One trajectory: the prompt, the generated response and one log-prob per response token.

    The response includes the token that ended it (EOS or a stop token). `is_replay` marks a
    trajectory spliced in from the experience pool (never regenerated); its `logprobs` are the
    recorded behaviour-policy log-probs.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    is_replay: bool = False
    # MoE, the megatron engine: the experts each fed token was routed to, [prompt + response - 1 tokens, MoE layers of
    # this rank, k] int16 (the last response token is never fed); None otherwise (model/routing_replay.py)
    expert_choices: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"{len(self.logprobs)} log-probs for {len(self.response_ids)} response tokens")


SampleCounts = int | Sequence[int]  # samples per prompt: one count for every prompt, or one per prompt


def sample_counts(prompts: list[list[int]], n: SampleCounts) -> list[int]:
    """The number of samples of each prompt of a `generate()` call: `n` for every prompt, or `n[i]` for prompt i
    (one call for groups of different sizes: fresh groups K samples, replayed groups K-1). Every count >= 1."""
    counts = [n] * len(prompts) if isinstance(n, int) else list(n)
    if len(counts) != len(prompts):
        raise ValueError(f"{len(counts)} sample counts for {len(prompts)} prompts")
    if any(c < 1 for c in counts):
        raise ValueError("n must be >= 1 for every prompt")
    return counts


def request_seeds_for(prompts: list[list[int]], n: SampleCounts, request_seeds: list[int] | None) -> list[int]:
    """Check a `generate()` call's requests (n >= 1 per prompt, no empty prompt, one seed per prompt) and return the
    per-request seeds; by default request i's seed is i. Shared by every engine."""
    sample_counts(prompts, n)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    seeds = list(range(len(prompts))) if request_seeds is None else list(request_seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} request seeds for {len(prompts)} prompts")
    return seeds


# on_prompts_done(indices, samples): prompts of a generate() call (indices into its `prompts`, ascending) whose n
# samples have all finished, with those samples; see RolloutEngine.
PromptsDone = Callable[[list[int], list[list[Sample]]], None]


class TextDecoder(Protocol):
    """What the engines need from a tokenizer: decoding (for stop strings) and the EOS id."""

    eos_token_id: int | None

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """Generation from the current policy weights, colocated with training.

    `generate(prompts, n, params, request_seeds)` returns, for each prompt, `n` samples in order (`n` a list:
    `n[i]` samples of prompt i, `sample_counts`). Sample j of prompt i is drawn with the seed derived from
    (params.seed, request_seeds[i], j), whatever the other prompts' counts;
    `request_seeds` defaults to the prompt's index in the call. What is guaranteed is engine
    specific and documented on each engine; all of them guarantee that every rank of one model
    replica (all TP and PP ranks) returns identical samples.

    `on_prompts_done`, when given, is called during the call each time the engine finishes a batch that
    completes some prompts, with those prompts and their samples (the engine's own batching: the megatron
    engine's chunks, vLLM's whole call); every prompt is reported exactly once before generate() returns.
    """

    tokens_per_second: float  # new tokens / wall seconds of the last generate() call

    def generate(
        self,
        prompts: list[list[int]],
        n: SampleCounts,
        params: SamplingParams,
        request_seeds: list[int] | None = None,
        on_prompts_done: PromptsDone | None = None,
    ) -> list[list[Sample]]: ...

    def update_weights(self) -> None:
        """Make the engine sample from the policy's current weights (no-op when it shares them)."""

    def sleep(self) -> None:
        """Free generation memory (KV cache, engine weights) before training."""

    def wake(self) -> None:
        """Re-acquire generation memory after training."""
