"""Batched sampling from the policy's own megatron-core GPTModel (colocated, any TP x PP).

A hand-written decode loop, run by every rank of a model replica (SPMD), over one of two stages: `KVCacheStage`
(rollout/kv_decode.py, the default: the model's megatron modules with a contiguous KV cache holding keys after RoPE,
so a decode step costs O(1) copies per layer) or `StaticContextStage` (megatron's own GPTModel.forward over
`StaticInferenceContext`, the reference, and the fallback for models with features KVCacheStage does not implement,
see `kv_decode.unsupported_reason`). Both give the same samples up to fp rounding of the logits (tested).

1. Batching. The call's rows (n per prompt, or n[i] for prompt i: fresh and replayed groups of a step in one call)
   are sorted by prompt length (longest first) and cut into chunks of `max_batch_sequences` rows. In a chunk each
   distinct prompt is prefilled ONCE and its KV cache is copied to its sample rows. Rows leave the decode batch as
   soon as they finish (their KV rows are dropped), and a chunk stops when every row has finished. After each chunk
   the prompts whose n rows have all finished go to `on_prompts_done` (rollout/types.py), so a caller can grade them
   while the next chunk generates.
2. Exactness. Prompts are left-padded; the attention mask hides pad keys (prefill: causal | pad; decode: pad).
   RoPE ignores position_ids, but scores depend only on relative positions, so a padded row equals the unpadded
   prompt up to fp rounding. This needs an attention that honours the boolean mask (KVCacheStage's and the local
   spec's do). With the megatron stage and any other core attention (TE on GPU) the engine batches only prompts of
   equal length (`pad_free_batches`), which needs no mask.
3. TP/PP. Logits are gathered over TP (`runtime_gather_output=True`, megatron's inference
   contract). Stages exchange activations with point-to-point send/recv over the default group;
   the last stage samples, TP rank 0 of the last stage broadcasts (token, log-prob) over TP, and
   the last stage broadcasts them over the PP group, so every rank of the replica holds identical
   tokens and decides stops identically.
4. Randomness. Counter-based (rollout/sampling.py): sample j of request i uses row_seed(params.seed,
   request_seeds[i], j) and step t. Guaranteed: for the same weights, prompt, seeds and params, a sample does not
   depend on the other prompts in the call, on max_batch_sequences, or on the TP/PP layout, except through fp
   rounding of the logits between different batch/padding shapes (~1e-7), which changes a token only when the
   uniform falls within that distance of a CDF boundary.
5. Expert parallelism (MoE, EP > 1). Every MoE layer of every forward exchanges tokens among the EP ranks, which
   generate different prompts (or none) with different response lengths and so run different numbers of forwards.
   Each forward is therefore one round agreed through the run's `Lockstep` (distributed/lockstep.py, site
   "generate"): every rank says whether it still generates, and a rank that has finished -- or had no prompt at
   all: `generate` with no prompts still joins -- runs every remaining round with a one-token forward of its own
   (no cache, its output unused) until none generates. The `alltoall` dispatcher carries the differing token
   counts. Callers must call `generate` on every rank, with an empty prompt list where a rank has none.
6. Stops. EOS -> "eos", a `stop_token_ids` token -> "stop" (the token stays in the response and has its log-prob),
   a decoded stop string -> "stop" with the response truncated right after the token that completed the string
   (text past the string inside that last token is kept; tokens are never split), `max_new_tokens` -> "length".

7. Continuous batching (`decode_loop="continuous"`, rollout/continuous.py): a finished row's slot takes the next
   row, over a static-shape decode step (rollout/static_decode.py: eager, compiled or CUDA-graphed); same samples.

The model is put in eval mode for the call and its training flag restored afterwards; no megatron global state is
changed (no InferenceMode, the input tensor is reset).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from exgrpo_megatron.distributed.lockstep import Lockstep
from exgrpo_megatron.model.moe import expert_parallel_group
from exgrpo_megatron.model.routing_replay import recording, router_choices
from exgrpo_megatron.rollout.continuous import ContinuousDecoder
from exgrpo_megatron.rollout.decode_loop import continuous_settings
from exgrpo_megatron.rollout.kv_decode import KVCacheStage, StaticContextStage, profile_range, unsupported_reason
from exgrpo_megatron.rollout.sampling import (
    find_stop_string,
    mask_padded_vocab,
    row_seed,
    sample_tokens,
    stop_window_tokens,
    uniform,
)
from exgrpo_megatron.rollout.types import (
    FinishReason,
    PromptsDone,
    Sample,
    SampleCounts,
    SamplingParams,
    TextDecoder,
    request_seeds_for,
    sample_counts,
)

Row = tuple[int, int, int]  # (prompt index, sample index, row seed)
GENERATE_SITE = "generate"  # the Lockstep site of the engine's forward rounds


def unwrap_model(model):
    """The bare GPTModel: unwrap a one-chunk list, DDP and Float16Module (`.module`)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError("virtual pipeline chunks are not supported by the megatron rollout engine")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def attention_honours_padding_mask(model) -> bool:
    """True when every core attention is megatron's local DotProductAttention (uses the mask)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
    return all(type(c) is DotProductAttention for c in cores)


def plan_chunks(prompt_lengths: list[int], rows: list[Row], max_rows: int, pad_free: bool) -> list[list[Row]]:
    """Sort rows by prompt length (longest first, then prompt, then sample) and cut into chunks of
    at most `max_rows`; with `pad_free` a chunk never mixes prompt lengths."""
    ordered = sorted(rows, key=lambda r: (-prompt_lengths[r[0]], r[0], r[1]))
    chunks: list[list[Row]] = []
    for r in ordered:
        same_len = not chunks or prompt_lengths[chunks[-1][0][0]] == prompt_lengths[r[0]]
        if chunks and len(chunks[-1]) < max_rows and (same_len or not pad_free):
            chunks[-1].append(r)
        else:
            chunks.append([r])
    return chunks


class MegatronRolloutEngine:
    """RolloutEngine over the policy's GPTModel; see the module docstring for the guarantees.

    `vocab_size` is the real vocabulary (ModelConfig.vocab_size): logits of megatron's padded ids
    are masked before sampling and log-probs (the trainer must mask them identically). `tokenizer`
    is anything with `decode(ids) -> str` and `eos_token_id` (needed only for stop strings / EOS).
    `decode_impl`: "kv_cache" (rollout/kv_decode.py, the default when the model supports it),
    "megatron" (GPTModel.forward over StaticInferenceContext) or "auto"; `last_stats["kv_cache"]`
    says which ran. `decode_loop`, `compile_decode`, `cuda_graphs`, `stop_check_every`, `max_model_len`: the
    continuous loop (docstring, 7.; `decode_loop.continuous_settings` resolves "auto").
    """

    def __init__(
        self,
        model,
        tokenizer: TextDecoder | None = None,
        *,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
        max_batch_sequences: int = 64,
        pad_free_batches: bool | None = None,
        decode_impl: str = "auto",
        decode_loop: str = "chunked",
        compile_decode: bool = False,
        cuda_graphs: str = "auto",
        stop_check_every: int = 4,
        max_model_len: int | None = None,
    ) -> None:
        self.model = unwrap_model(model)
        self.decode: Callable[[list[int]], str] | None = tokenizer.decode if tokenizer is not None else None
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.vocab_size = vocab_size
        if max_batch_sequences < 1:
            raise ValueError("max_batch_sequences must be >= 1")
        self.max_batch_sequences = max_batch_sequences
        if decode_impl not in ("auto", "kv_cache", "megatron"):
            raise ValueError(f"decode_impl must be auto, kv_cache or megatron, got {decode_impl!r}")
        if decode_impl == "auto":
            decode_impl = "kv_cache" if unsupported_reason(self.model) is None else "megatron"
        elif decode_impl == "kv_cache" and (why := unsupported_reason(self.model)) is not None:
            raise ValueError(f"decode_impl='kv_cache' does not support this model: {why}")
        self.decode_impl = decode_impl
        if pad_free_batches is None:  # the kv_cache attention always honours the padding mask
            pad_free_batches = decode_impl == "megatron" and not attention_honours_padding_mask(self.model)
        self.pad_free_batches = pad_free_batches
        self.tokens_per_second = 0.0
        self.last_stats: dict[str, float] = {}
        self.routers = router_choices(self.model)  # MoE: each token's experts are recorded (model/routing_replay.py)
        self.lockstep = Lockstep(expert_parallel_group(self.model))  # MoE at EP > 1: forwards in rounds (docstring, 5.)
        step_mode = continuous_settings(self.model, decode_loop, compile_decode, cuda_graphs, decode_impl)
        self.continuous = None if step_mode is None else ContinuousDecoder(
            self.model, slots=max_batch_sequences, mode=step_mode, stop_check_every=stop_check_every,
            max_len=max_model_len, vocab_size=vocab_size, eos_token_id=self.eos_token_id,
            finish_reason=self._finish_reason)

    # ---------------------------------------------------------------- RolloutEngine protocol
    def update_weights(self) -> None:
        """No-op: the engine samples from the training model's own parameters."""

    def sleep(self) -> None:
        """No-op: the KV cache lives only inside a generate() call."""

    def wake(self) -> None:
        """No-op (see sleep)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: SampleCounts,
        params: SamplingParams,
        request_seeds: list[int] | None = None,
        on_prompts_done: PromptsDone | None = None,
    ) -> list[list[Sample]]:
        seeds = request_seeds_for(prompts, n, request_seeds)
        counts = sample_counts(prompts, n)
        if params.stop_strings and self.decode is None:
            raise ValueError("stop_strings need a tokenizer with decode()")
        start = time.perf_counter()
        rows = [(i, j, row_seed(params.seed, seeds[i], j)) for i in range(len(prompts)) for j in range(counts[i])]
        chunks = plan_chunks([len(p) for p in prompts], rows, self.max_batch_sequences, self.pad_free_batches)
        results: list[dict[int, Sample]] = [{} for _ in prompts]  # sample index -> sample, per prompt
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                if self.continuous is not None:
                    ordered = [r for chunk in chunks for r in chunk]
                    results = self.continuous.generate(prompts, ordered, params, counts, on_prompts_done)
                for chunk in chunks if self.continuous is None else []:
                    for (i, j, _), sample in zip(chunk, self._generate_chunk(prompts, chunk, params), strict=True):
                        results[i][j] = sample
                    if on_prompts_done is not None:
                        # completed in this chunk: a row here, and now all its samples (rows are never repeated)
                        done = sorted({i for i, _, _ in chunk if len(results[i]) == counts[i]})
                        on_prompts_done(done, [[results[i][j] for j in range(counts[i])] for i in done])
                self._finish_ep_rounds()
        finally:
            self.model.set_input_tensor(None)
            self.model.train(was_training)
        samples = [[group[j] for j in range(c)] for group, c in zip(results, counts, strict=True)]
        seconds = time.perf_counter() - start
        new_tokens = sum(len(s.response_ids) for group in samples for s in group)
        self.tokens_per_second = new_tokens / max(seconds, 1e-9)
        self.last_stats = {"new_tokens": float(new_tokens), "seconds": seconds, "chunks": float(len(chunks)),
                           "kv_cache": float(self.decode_impl == "kv_cache"),
                           "continuous": float(self.continuous is not None)}
        return samples

    # ---------------------------------------------------------------- one chunk
    def _generate_chunk(self, prompts: list[list[int]], chunk: list[Row], params: SamplingParams) -> list[Sample]:
        device = next(self.model.parameters()).device
        unique = list(dict.fromkeys(i for i, _, _ in chunk))
        slot = {p: k for k, p in enumerate(unique)}
        prompt_len = max(len(prompts[i]) for i in unique)
        total_len = prompt_len + params.max_new_tokens
        batch = len(chunk)

        tokens = torch.zeros(len(unique), prompt_len, dtype=torch.long, device=device)
        valid = torch.zeros(len(unique), total_len, dtype=torch.bool, device=device)  # real (non-pad) keys
        for k, i in enumerate(unique):
            p = prompts[i]
            tokens[k, prompt_len - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
            valid[k, prompt_len - len(p): prompt_len] = True

        stage = self._stage(batch, total_len)
        with recording(self.routers) as experts:
            return self._decode_chunk(prompts, chunk, params, stage, tokens, valid, slot, experts)

    def _decode_chunk(self, prompts: list[list[int]], chunk: list[Row], params: SamplingParams, stage,
                      tokens: torch.Tensor, valid: torch.Tensor, slot: dict[int, int], experts) -> list[Sample]:
        """Prefill (prompt i in `tokens` row `slot[i]`), then sample and feed one token per step until every row
        finished; `experts(seq, batch)`: the last forward's expert choices (MoE) or None."""
        device = tokens.device
        batch, (n_unique, prompt_len) = len(chunk), tokens.shape
        expand = torch.tensor([slot[i] for i, _, _ in chunk], device=device)
        with profile_range("prefill"):
            logits = self._forward(stage, tokens, valid, start=0)  # prefill: each distinct prompt once
            prefill_experts = experts(prompt_len, n_unique)  # [s, b, layers, k] or None
            if batch > n_unique:  # ... its KV rows copied to its sample rows
                stage.select_rows(expand)
                valid = valid[expand]
                logits = logits[expand] if logits is not None else None

        seeds = [r[2] for r in chunk]
        active = list(range(batch))
        responses: list[list[int]] = [[] for _ in chunk]
        logprobs: list[list[float]] = [[] for _ in chunk]
        finish: list[FinishReason | None] = [None] * batch
        window = stop_window_tokens(params.stop_strings)
        fed_experts: list[list[np.ndarray]] = [[] for _ in chunk]  # per row: each fed response token's experts
        for step in range(params.max_new_tokens):
            uniforms = torch.tensor([uniform(seeds[a], step) for a in active], dtype=torch.float64)
            new_tokens, new_logprobs = self._sample_and_share(logits, uniforms, params, len(active), device)
            keep: list[int] = []
            drawn = zip(active, new_tokens.tolist(), new_logprobs.tolist(), strict=True)
            for pos, (a, token, logprob) in enumerate(drawn):
                responses[a].append(token)
                logprobs[a].append(logprob)
                finish[a] = self._finish_reason(token, responses[a], params, window)
                if finish[a] is None and step == params.max_new_tokens - 1:
                    finish[a] = "length"
                if finish[a] is None:
                    keep.append(pos)
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows from the decode batch
                index = torch.tensor(keep, device=device)
                stage.select_rows(index)
                valid, new_tokens = valid[index], new_tokens[keep]  # new_tokens lives on the CPU
                active = [active[k] for k in keep]
            position = prompt_len + step
            valid[:, position] = True
            logits = self._forward(stage, new_tokens[:, None].to(device), valid, start=position)
            if prefill_experts is not None:
                step_experts = experts(1, len(active))
                for pos, a in enumerate(active):
                    fed_experts[a].append(step_experts[0, pos])
        samples = []
        for a, (i, _, _) in enumerate(chunk):
            choices = None
            if prefill_experts is not None:  # the prompt's tokens (left-padded in the prefill), then the fed ones
                prompt = prefill_experts[prompt_len - len(prompts[i]):, slot[i]]
                choices = np.concatenate([prompt, np.stack(fed_experts[a]) if fed_experts[a]
                                          else prompt[:0]])
            samples.append(Sample(list(prompts[i]), responses[a], logprobs[a], finish[a],  # type: ignore[arg-type]
                                  expert_choices=choices))
        return samples

    def _finish_reason(
        self, token: int, response: list[int], params: SamplingParams, window: int
    ) -> FinishReason | None:
        if self.eos_token_id is not None and token == self.eos_token_id:
            return "eos"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop_strings and find_stop_string(self.decode, response, params.stop_strings, window):
            return "stop"
        return None

    # ---------------------------------------------------------------- model + communication
    def _stage(self, batch: int, max_len: int):
        if self.decode_impl == "kv_cache":
            return KVCacheStage(self.model, max_len)
        return StaticContextStage(self.model, batch, max_len)

    def _forward(self, stage, tokens: torch.Tensor, valid: torch.Tensor, start: int) -> torch.Tensor | None:
        """Run this rank's stage on [b, s] tokens at positions start..start+s-1 (keys: `valid`
        [b, >= start+s]); return last-position logits [b, V] on the last stage (padded vocab
        masked), None elsewhere. Stages exchange [s, b, h] activations point-to-point."""
        from megatron.core import parallel_state as ps

        self._ep_round(generating=True)
        batch, seq = tokens.shape
        pp = ps.get_pipeline_model_parallel_world_size()
        hidden = None
        if pp > 1 and not ps.is_pipeline_first_stage():
            cfg = self.model.config
            hidden = torch.empty(seq, batch, cfg.hidden_size, dtype=cfg.pipeline_dtype or cfg.params_dtype,
                                 device=tokens.device)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        out = stage.forward(tokens, hidden, start, valid)
        if pp > 1 and not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        logits = out.float()
        return mask_padded_vocab(logits, self.vocab_size) if self.vocab_size is not None else logits

    def _ep_round(self, generating: bool) -> bool:
        """One forward round (docstring, 5.): True while any rank still generates (EP = 1: `generating`)."""
        return self.lockstep.agree(GENERATE_SITE, int(generating)) > 0

    def _finish_ep_rounds(self) -> None:
        """This rank is done: a one-token forward in every round another EP rank still generates."""
        if not self.lockstep.expert_parallel:
            return
        device = next(self.model.parameters()).device
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        valid = torch.ones(1, 1, dtype=torch.bool, device=device)
        stage = KVCacheStage(self.model, max_len=1)  # position 0 rewritten each round
        while self._ep_round(generating=False):
            stage.forward(one, None, 0, valid)

    def _sample_and_share(
        self, logits: torch.Tensor | None, uniforms: torch.Tensor, params: SamplingParams, batch: int, device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample on the last stage; make (token, log-prob) identical on every TP and PP rank."""
        from megatron.core import parallel_state as ps

        shared = torch.zeros(batch, 2, dtype=torch.float64, device=device)  # tokens < 2**53 are exact
        if logits is not None:
            with profile_range("sampling"):
                tok, logp = sample_tokens(logits, uniforms, params.temperature, params.top_p, params.top_k)
            shared[:, 0], shared[:, 1] = tok.double(), logp.double()
            if ps.get_tensor_model_parallel_world_size() > 1:
                dist.broadcast(shared, src=ps.get_tensor_model_parallel_src_rank(),
                               group=ps.get_tensor_model_parallel_group())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(shared, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return shared[:, 0].long().cpu(), shared[:, 1].float().cpu()
