"""Continuous batching over the static decode step (rollout/static_decode.py): the megatron engine's
`decode_loop="continuous"`.

The call's rows (prompt, sample, row seed) wait in the chunked loop's order (longest prompt first). Each free slot
takes the next row: its prompt is prefilled once at positions 0..len-1 by a one-prompt `KVCacheStage` (kept until
every sample row of the prompt has a slot), the prompt's keys and values are copied to the slot, and the row's first
token is drawn from the prefill's logits. Then the step runs `stop_check_every` times over the smallest bucket
holding every occupied slot; the host reads the finished flags and draw counts once, scans each row's new tokens with
the engine's own stop rule (EOS, stop ids, stop strings, length: the same first stopping token as the chunked loop,
later draws are discarded), hands finished rows back, and refills their slots. When no row waits, occupied slots
are moved to the lowest indices so the batch shrinks to a smaller bucket.

Same samples as the chunked loop: a row's draws depend only on its prompt, its seed and the step count (counter-based
uniforms), never on which rows share the batch; the logits differ by the fp rounding of another batch / padding
shape (no padding here: each row's prompt starts at position 0).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from exgrpo_megatron.rollout.kv_decode import KVCacheStage, profile_range
from exgrpo_megatron.rollout.sampling import stop_window_tokens
from exgrpo_megatron.rollout.static_decode import (
    DecodeSlots,
    DecodeStep,
    StepConstants,
    as_int64,
    bucket_for,
    decode_buckets,
    record_draws,
)
from exgrpo_megatron.rollout.types import FinishReason, PromptsDone, Sample, SamplingParams

Row = tuple[int, int, int]  # (prompt index, sample index, row seed), as the chunked loop's
FinishRule = Callable[[int, list[int], SamplingParams, int], "FinishReason | None"]


class ContinuousDecoder:
    """Slots, step and host loop of one engine; the device buffers persist across calls while their shape fits
    (`max_len`: prompt + response tokens a call may need; None: sized by the first call, regrown when exceeded)."""

    def __init__(self, model, *, slots: int, mode: str, stop_check_every: int, max_len: int | None,
                 vocab_size: int | None, eos_token_id: int | None, finish_reason: FinishRule) -> None:
        if stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
        self.model, self.slot_count, self.check_every, self.max_len = model, slots, stop_check_every, max_len
        self.vocab_size, self.eos_token_id, self.finish_reason = vocab_size, eos_token_id, finish_reason
        self.step = DecodeStep(model, mode)
        self.slots: DecodeSlots | None = None
        self.steps_run = 0

    def _buffers(self, need_len: int, max_new_tokens: int) -> DecodeSlots:
        max_len = max(self.max_len or 0, need_len)
        if self.slots is None or not self.slots.fits(self.slot_count, max_len, max_new_tokens):
            self.slots = DecodeSlots(self.model, self.slot_count, max_len, max_new_tokens)
            self.step.copies.clear()  # compiled copies / graphs hold the old buffers
        return self.slots

    def generate(self, prompts: list[list[int]], rows: list[Row], params: SamplingParams, counts: list[int],
                 on_prompts_done: PromptsDone | None) -> list[dict[int, Sample]]:
        slots = self._buffers(max(len(p) for p in prompts) + params.max_new_tokens, params.max_new_tokens)
        const = StepConstants(params.max_new_tokens, params.temperature, params.top_p, params.top_k,
                              self.eos_token_id, tuple(params.stop_token_ids), self.vocab_size)
        buckets = decode_buckets(slots.slots)
        results: list[dict[int, Sample]] = [{} for _ in prompts]
        loop = _CallState(prompts, rows, slots.slots)
        while True:
            self._admit(loop, slots, const)
            occupied = [s for s, row in enumerate(loop.occupant) if row is not None]
            if not occupied:
                break
            if not loop.pending and bucket_for(len(occupied), buckets) < bucket_for(occupied[-1] + 1, buckets):
                slots.move_rows(occupied)  # the tail: shrink to a smaller bucket
                loop.occupant = [loop.occupant[s] for s in occupied] + [None] * (slots.slots - len(occupied))
                loop.scanned = [loop.scanned[s] for s in occupied] + [0] * (slots.slots - len(occupied))
                occupied = list(range(len(occupied)))
            bucket = bucket_for(occupied[-1] + 1, buckets)
            for _ in range(self.check_every):
                self.step.run(slots, bucket, const)
            self.steps_run += self.check_every
            done = self._collect(loop, slots, bucket, params, results, counts)
            if on_prompts_done is not None and done:
                on_prompts_done(done, [[results[i][j] for j in range(counts[i])] for i in done])
        return results

    def _admit(self, loop: _CallState, slots: DecodeSlots, const: StepConstants) -> None:
        """Free slots take the next waiting rows: prefill (once per prompt), KV copy, first draw."""
        free = [s for s, row in enumerate(loop.occupant) if row is None]
        taken: list[tuple[int, Row]] = []
        while free and loop.pending:
            taken.append((free.pop(0), loop.pending.popleft()))
        if not taken:
            return
        logits = []
        with profile_range("prefill"):
            for s, row in taken:
                stage, prompt_logits = loop.prefill(self.model, row[0])
                length = len(loop.prompts[row[0]])
                for (k_cache, v_cache), (k, v) in zip(slots.caches, stage.cache, strict=True):
                    k_cache[s, :, :length] = k[0, :, :length]
                    v_cache[s, :, :length] = v[0, :, :length]
                slots.valid[s] = False
                slots.valid[s, :length] = True
                slots.position[s], slots.seed[s], slots.count[s] = length, as_int64(row[2]), 0
                slots.finished[s] = False
                loop.occupant[s], loop.scanned[s] = row, 0
                logits.append(prompt_logits)
        index = torch.tensor([s for s, _ in taken], dtype=torch.long, device=slots.valid.device)
        record_draws(slots, index, torch.cat(logits), const)

    def _collect(self, loop: _CallState, slots: DecodeSlots, bucket: int, params: SamplingParams,
                 results: list[dict[int, Sample]], counts: list[int]) -> list[int]:
        """One host read: finish rows whose draws reached a stop; return the prompts now complete."""
        finished, drawn = slots.finished[:bucket].tolist(), slots.count[:bucket].tolist()
        look = [s for s in range(bucket) if loop.occupant[s] is not None and (finished[s] or params.stop_strings)]
        if not look:
            return []
        width = max(drawn[s] for s in look)
        index = torch.tensor(look, dtype=torch.long, device=slots.valid.device)
        tokens, logprobs = slots.drawn[index, :width].tolist(), slots.logprobs[index, :width].tolist()
        window = stop_window_tokens(params.stop_strings)
        done: list[int] = []
        for s, row_tokens, row_logprobs in zip(look, tokens, logprobs, strict=True):
            row = loop.occupant[s]
            assert row is not None
            end, reason = None, None
            for t in range(loop.scanned[s], drawn[s]):
                reason = self.finish_reason(row_tokens[t], row_tokens[: t + 1], params, window)
                if reason is None and t == params.max_new_tokens - 1:
                    reason = "length"
                if reason is not None:
                    end = t + 1
                    break
            if end is None or reason is None:
                assert not finished[s], "a row the device finished has no stopping token"
                loop.scanned[s] = drawn[s]
                continue
            i, j, _ = row
            results[i][j] = Sample(list(loop.prompts[i]), row_tokens[:end], row_logprobs[:end], reason)
            loop.occupant[s] = None
            slots.finished[s] = True
            if len(results[i]) == counts[i]:
                done.append(i)
        return sorted(done)


class _CallState:
    """Host bookkeeping of one generate call: waiting rows, slot occupants, prefills in use."""

    def __init__(self, prompts: list[list[int]], rows: list[Row], slots: int) -> None:
        self.prompts = prompts
        self.pending: deque[Row] = deque(rows)
        self.occupant: list[Row | None] = [None] * slots
        self.scanned = [0] * slots  # draws of the slot's row already scanned for stops
        self.waiting = {i: sum(1 for r in rows if r[0] == i) for i in {r[0] for r in rows}}  # rows without a slot
        self.prefills: dict[int, tuple[KVCacheStage, torch.Tensor]] = {}

    def prefill(self, model, prompt: int) -> tuple[KVCacheStage, torch.Tensor]:
        """The prompt's prefilled stage and last-position logits [1, V]; dropped once its last row takes a slot."""
        if prompt not in self.prefills:
            ids = torch.tensor([self.prompts[prompt]], dtype=torch.long, device=next(model.parameters()).device)
            stage = KVCacheStage(model, ids.shape[1])
            valid = torch.ones_like(ids, dtype=torch.bool)
            self.prefills[prompt] = (stage, stage.forward(ids, None, 0, valid).float())  # logits [1, V]
        found = self.prefills[prompt]
        self.waiting[prompt] -= 1
        if self.waiting[prompt] == 0:
            del self.prefills[prompt]
        return found
