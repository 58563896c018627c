"""One ExGRPO update's loss through the LoRA adapters against a float64 reference.

The production path: a real megatron GPT with adapters (local spec, fp32), pi_old from the scoring pass
(`token_stats`), the update's micro-batches (`micro_batches_for_update`, padded and packed) and the algorithm's loss
(`rl_loss_fn`), fresh rows and rows replayed from the pool (policy shaping f(w) = w / (w + beta)), at DP=1 and DP=2
with unequal rows per rank. The reference is float64 and independent of the adapters' code and of algo/: a megatron
GPT built WITHOUT adapters, converted to float64 (`.double()`), whose adapted linears' weights are replaced (through
`torch.func.functional_call`) by W + B A alpha / r computed here from float64 leaves A and B; each row runs alone
(no padding, no packing), and the loss is written out token by token below. Compared: the loss, the gradient of
every adapter A and B, pi_old of the scoring pass; the base weights have no gradient.
"""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.algo.registry import settings_in_effect
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.model.param_layout import is_adapter
from tests.helpers.gather import full_tensors, load_full_tensors, with_random_lora_b
from tests.helpers.multirank import run_on_ranks
from tests.test_moe_parallel import _rows

RANK, ALPHA = 4, 16.0  # scale 4: applied twice (16) or left out (1) is visible
MAX_TOKENS = 24  # several micro-batches per rank


def _rank_rows(n_rows: int, dp: int, dp_rank: int) -> list[int]:
    """DP=2: rank 0 takes 4 rows, rank 1 the other 2 (unequal rows and tokens)."""
    if dp == 1:
        return list(range(n_rows))
    return [i for i in range(n_rows) if (i in (0, 1, 2, 4)) == (dp_rank == 0)]


def reference_loss(logits: list[torch.Tensor], rows, old: list[torch.Tensor], *, mixed: bool, clip: float,
                   beta: float, entropy_coeff: float, pg_normaliser: float, entropy_normaliser: float
                   ) -> torch.Tensor:
    """float64 ExGRPO loss of whole rows from their logits [len, V]: fresh tokens -A rho (warm-up: PPO's clip) with
    rho = pi / pi_old, replayed tokens -A f(w), w = pi / pi_recorded, f(w) = w / (w + beta); minus the entropy
    bonus. Written out here, not taken from algo/."""
    pg = ent = logits[0].new_zeros(())
    for i, row_logits in enumerate(logits):
        p = rows.prompt_lengths[i]
        targets = torch.tensor(rows.sequences[i][p:])
        logp_all = torch.log_softmax(row_logits[p - 1:-1], dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        ent = ent + (-(logp_all.exp() * logp_all).sum(-1)).sum()
        adv = float(rows.advantages[i])
        if rows.is_replay[i]:
            w = torch.exp(logp - rows.behaviour_logprobs[i].double())
            pg = pg + (-adv * w / (w + beta)).sum()
        else:
            rho = torch.exp(logp - old[i].double())
            unclipped = -adv * rho
            pg = pg + (unclipped if mixed else torch.maximum(unclipped, -adv * rho.clamp(1 - clip, 1 + clip))).sum()
    return pg / pg_normaliser - entropy_coeff * ent / entropy_normaliser


def _reference_logits(cfg, base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], rows,
                      use_mask: bool) -> list[torch.Tensor]:
    """Each row's logits [len, V] from a float64 megatron GPT without adapters whose adapted weights are
    W + B A alpha / r."""
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    from exgrpo_megatron.model.builder import build_gpt_model, causal_attention_mask

    model = build_gpt_model(cfg.model, cfg.parallel).double().eval()
    assert not any(is_adapter(n) for n, _ in model.named_parameters())
    assert get_tensor_model_parallel_group().size() == 1
    params = {}
    for name, _ in model.named_parameters():
        w = base[name].double()
        a_name = name.removesuffix("weight") + "lora_a"
        if a_name in adapters:
            b_name = name.removesuffix("weight") + "lora_b"
            w = w + adapters[b_name] @ adapters[a_name] * (ALPHA / RANK)
        params[name] = w
    out = []
    for seq in rows.sequences:
        n = len(seq)
        mask = causal_attention_mask(n, 1) if use_mask else None
        logits = torch.func.functional_call(model, params, args=(torch.tensor([seq]), torch.arange(n)[None], mask))
        out.append(logits[0])
    return out


def lora_exgrpo_update(packed: bool, phase_name: str) -> dict:
    """One update of the policy with adapters (B drawn non-zero) on this rank's rows, and on every rank the float64
    reference of the whole batch."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import TrainBatch, micro_batches_for_update, token_stats

    cfg = load_config("demo_cpu", ["model=tiny_qwen2", "model.params_dtype=fp32", "trainer.total_steps=1",
                                   f"lora.rank={RANK}", f"lora.alpha={ALPHA}",
                                   f"trainer.sequence_packing={str(packed).lower()}"])
    layout = init_distributed(1, 1, seed=cfg.seed)
    policy = Policy(cfg)
    full = with_random_lora_b(full_tensors(policy.modules, "data"), seed=3)
    load_full_tensors(policy.modules, full)

    base_rows = _rows()  # two groups of three, the last row of each replayed
    seqs, prompts = base_rows.sequences, base_rows.prompt_lengths
    scored = token_stats(policy, seqs, prompts, site="old_logprobs", temperature=1.0, with_entropy=False,
                         max_tokens=MAX_TOKENS).logprobs  # pi_old: the scoring pass, as the trainer recomputes it
    noise = torch.Generator().manual_seed(4)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=noise) for lp in scored]  # ratios on both sides of the clip
    recorded = [lp + 0.5 * torch.randn(lp.shape, generator=noise) for lp in scored]  # replay: w around 1
    rows = type(base_rows)(seqs, prompts, recorded, base_rows.rewards, base_rows.advantages, base_rows.is_replay,
                           base_rows.group_index)
    batch = TrainBatch.of(rows, old_logprobs=old)

    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    phase = Phase(phase_name)
    mine = _rank_rows(len(seqs), layout.dp_size, layout.dp_rank)
    counts = global_loss_counts([batch.response_lengths[i] for i in mine], ps.get_data_parallel_group())
    losses: list[torch.Tensor] = []
    loss_fn = rl_loss_fn(algorithm, phase=phase, normalisers=algorithm.normalisers(*counts), temperature=1.0,
                         observe=lambda output, mb, loss, metrics: losses.append(loss.detach()))
    policy.train()
    policy.zero_grad()
    mbs = micro_batches_for_update(batch, mine, MAX_TOKENS, packed=packed)
    policy.forward_backward(mbs, loss_fn, site="update")
    loss = torch.stack(losses).sum().double()
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    grads = full_tensors(policy.modules, "grad", trainable_only=True)
    base_params = [(n, p) for m in policy.modules for n, p in m.named_parameters() if not is_adapter(n)]
    base_grad = [n for n, p in base_params if p.requires_grad or p.grad is not None or hasattr(p, "main_grad")]

    # float64 reference of the whole batch (every row, every rank), independent of the adapters' code and of algo/
    weights = {n: p.detach() for m in policy.modules for n, p in m.named_parameters()}
    adapters = {n: w.double().requires_grad_() for n, w in weights.items() if is_adapter(n)}
    ref_logits = _reference_logits(cfg, weights, adapters, rows, policy.use_mask)
    a = cfg.algo
    n_tok = float(sum(batch.response_lengths))
    ref = reference_loss(ref_logits, rows, old, mixed=phase != Phase.WARMUP, clip=a.clip_ratio,
                         beta=settings_in_effect(a)["shaping_beta"], entropy_coeff=a.entropy_coeff,
                         pg_normaliser=cfg.data.max_response_length * len(seqs) / a.loss_seqs_per_rank_ref,
                         entropy_normaliser=n_tok / a.entropy_microbatches_ref)
    ref.backward()
    ref_scored = []
    for i, row_logits in enumerate(ref_logits):
        p = prompts[i]
        lp = torch.log_softmax(row_logits[p - 1:-1].detach(), -1)
        ref_scored.append(lp.gather(-1, torch.tensor(seqs[i][p:])[:, None]).squeeze(-1))
    in_effect = settings_in_effect(a)
    assert a.loss_agg_mode == "token_sum_constant" and in_effect["policy_shaping"] and in_effect["replay_tis_cap"] == 0
    return {"loss": float(loss), "ref_loss": float(ref), "grads": grads,
            "ref_grads": {n: t.grad for n, t in adapters.items()}, "base_with_grad": base_grad,
            "n_base": len(base_params), "scored": scored, "ref_scored": ref_scored, "rows": len(mine),
            "micro_batches": len(mbs)}


def _check(got: dict) -> None:
    assert got["n_base"] > 0 and not got["base_with_grad"], got["base_with_grad"]
    assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * abs(got["ref_loss"]), (got["loss"], got["ref_loss"])
    assert set(got["grads"]) == set(got["ref_grads"]) and len(got["grads"]) == 4 * 2 * 2  # 2 layers x 4 linears
    for name, want in got["ref_grads"].items():
        assert want.abs().max() > 0, name
        err = float((got["grads"][name].double() - want).abs().max() / want.abs().max())
        assert err <= 1e-5, (name, err)
    for lp, want in zip(got["scored"], got["ref_scored"], strict=True):
        assert float((lp.double() - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("packed, phase", [(False, "mixed"), (True, "mixed"), (True, "warmup")])
def test_lora_exgrpo_update_equals_float64_reference(packed, phase):
    got = run_on_ranks(lora_exgrpo_update, 1, args=(packed, phase))[0]
    assert got["rows"] == 6 and got["micro_batches"] > 1
    _check(got)


def test_lora_exgrpo_update_at_dp2_with_unequal_rows_equals_float64_reference():
    per_rank = run_on_ranks(lora_exgrpo_update, 2, args=(True, "mixed"))
    assert [r["rows"] for r in per_rank] == [4, 2]
    for got in per_rank:
        _check(got)
