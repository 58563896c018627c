"""The loss scale against the original ExGRPO code at the paper's layout.

The original (verl fork, `mix_core_alg.compute_token_on_off_policy_loss` with loss_remove_token_mean=True,
`mix_actor.update_policy`, FSDP gradient averaging) is re-implemented below in float64, from its formula:
per rank r and micro-batch b, l_rb = sum_{i,t} m*l / T_max - c * token_mean_b(H), divided by gradient_accumulation
(= 1 at ppo_mini = ppo_micro = 64), and the update follows the gradient of (1/DP) sum_r sum_b l_rb. The paper's
layout: 8 ranks, 512 sequences per mini-batch (64 prompts x 8), i.e. 64 sequences per rank.
Ours (one process holding the whole mini-batch, or any DP split) must give the same loss value and the same
gradient, so clipping at 1.0, the skip bound 500 and the entropy balance act on the original's scale.
"""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.algo.loss import global_loss_counts, loss_normalisers
from exgrpo_megatron.config.loader import load_config
from tests.helpers.exgrpo_loss import exgrpo_loss

T_MAX = 64
DP_PAPER, SEQS_PER_RANK = 8, 64
COEFF = 0.001


def paper_batch(seed: int, equal_lengths: bool = False) -> dict:
    """512 sequences (64 groups of 8) with a mix of fresh and replayed rows, in rank-major order."""
    g = torch.Generator().manual_seed(seed)
    n = DP_PAPER * SEQS_PER_RANK
    lengths = torch.full((n,), 40) if equal_lengths else torch.randint(1, T_MAX + 1, (n,), generator=g)
    mask = torch.arange(T_MAX)[None, :] < lengths[:, None]
    old = -torch.rand(n, T_MAX, generator=g, dtype=torch.float64) * 3
    return dict(lp=(old + 0.3 * torch.randn(n, T_MAX, generator=g, dtype=torch.float64)).requires_grad_(True),
                old=old, beh=old + 0.5 * torch.randn(n, T_MAX, generator=g, dtype=torch.float64),
                adv=torch.randn(n, generator=g, dtype=torch.float64), mask=mask,
                replay=torch.tensor([i % 8 == 0 and (i // 8) % 2 == 0 for i in range(n)]),
                ent=(torch.rand(n, T_MAX, generator=g, dtype=torch.float64) * 2).requires_grad_(True))


def original_token_loss(b: dict, mixed: bool) -> torch.Tensor:
    """The original's per-token loss (float64): fresh -A*rho (mixed) / PPO clip 0.2 (warm-up); replay -A*w/(w+0.1)."""
    adv = b["adv"][:, None]
    rho = torch.exp(b["lp"] - b["old"])
    fresh = -adv * rho if mixed else torch.maximum(-adv * rho, -adv * torch.clamp(rho, 0.8, 1.2))
    w = torch.exp(b["lp"] - b["beh"])
    return torch.where(b["replay"][:, None], -adv * w / (w + 0.1), fresh)


def original_loss(b: dict, mixed: bool, micro_per_rank: int) -> torch.Tensor:
    """(1/DP) sum_ranks sum_micro [sum m*l / T_max - c * masked_mean_micro(H)] / grad_accum (= 1)."""
    per_token = original_token_loss(b, mixed)
    m = b["mask"].to(torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for r in range(DP_PAPER):
        rows = torch.arange(r * SEQS_PER_RANK, (r + 1) * SEQS_PER_RANK)
        for micro in torch.tensor_split(rows, micro_per_rank):
            pg = (per_token[micro] * m[micro]).sum() / T_MAX  # loss_remove_token_mean: sum / eos_mask.shape[-1]
            ent = (b["ent"][micro] * m[micro]).sum() / m[micro].sum()
            total = total + (pg - COEFF * ent) / 1  # gradient_accumulation = 64 // 64
    return total / DP_PAPER  # FSDP averages gradients over DP ranks


def our_loss(b: dict, mixed: bool, dp: int, seqs_per_rank_ref: float, entropy_microbatches_ref: float = 1.0
             ) -> torch.Tensor:
    """Ours on `dp` ranks (each its contiguous share, global counts), summed over ranks as the gradients are."""
    n_tok, n_seq = global_loss_counts(b["mask"].sum(-1).tolist())
    pg_norm, ent_norm = loss_normalisers(n_tok, n_seq, "token_sum_constant", T_MAX, seqs_per_rank_ref,
                                         entropy_microbatches_ref)
    total = torch.zeros((), dtype=torch.float64)
    for rows in torch.tensor_split(torch.arange(b["mask"].shape[0]), dp):
        loss, _ = exgrpo_loss(b["lp"][rows], b["old"][rows], b["beh"][rows], b["adv"][rows], b["mask"][rows],
                              b["replay"][rows], b["ent"][rows], mixed_phase=mixed, entropy_coeff=COEFF,
                              pg_normaliser=pg_norm, entropy_normaliser=ent_norm)
        total = total + loss
    return total


def value_and_grads(fn) -> tuple[float, torch.Tensor, torch.Tensor]:
    b = paper_batch(0, equal_lengths=True)
    loss = fn(b)
    g_lp, g_ent = torch.autograd.grad(loss, [b["lp"], b["ent"]])
    return float(loss), g_lp, g_ent


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_matches_original_at_paper_layout(mixed, dp):
    """Equal token counts per rank and one micro-batch per rank (the original's configured accumulation): loss
    value and gradient (policy-gradient AND entropy parts) equal the original's, whatever our DP size."""
    ref = value_and_grads(lambda b: original_loss(b, mixed, micro_per_rank=1))
    ours = value_and_grads(lambda b: our_loss(b, mixed, dp, SEQS_PER_RANK))
    assert ours[0] == pytest.approx(ref[0], rel=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-18)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-12, atol=1e-18)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 8])
@pytest.mark.parametrize("micro_per_rank", [2, 4])
def test_entropy_bonus_matches_original_dynamic_micro_batches(mixed, dp, micro_per_rank):
    """The original SUMS c x token-mean over its dynamic micro-batches (token-balanced, so equal token counts
    here): with algo.entropy_microbatches_ref = that count, loss value and both gradients equal the original's
    for any DP size of ours. Without it (ref = 1) the entropy gradient is micro_per_rank x too weak."""
    ref = value_and_grads(lambda b: original_loss(b, mixed, micro_per_rank=micro_per_rank))
    ours = value_and_grads(lambda b: our_loss(b, mixed, dp, SEQS_PER_RANK, float(micro_per_rank)))
    assert ours[0] == pytest.approx(ref[0], rel=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-18)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-12, atol=1e-18)
    weak = value_and_grads(lambda b: our_loss(b, mixed, dp, SEQS_PER_RANK, 1.0))
    torch.testing.assert_close(weak[2] * micro_per_rank, ref[2], rtol=1e-12, atol=1e-18)


def test_paper_preset_entropy_weight_is_the_original_layouts():
    """conf/algo's default is the paper layout's micro-batch count (4); the demo keeps the weight it was tuned at."""
    assert load_config("exgrpo_7b").algo.entropy_microbatches_ref == 4
    assert load_config("demo_cpu").algo.entropy_microbatches_ref == 1


@pytest.mark.parametrize("mixed", [False, True])
def test_policy_gradient_term_matches_for_any_lengths_and_micro_batching(mixed):
    """The pg term alone (entropy coefficient 0 on both sides) matches for ragged lengths and the original's
    dynamic micro-batches: it is additive, so only the constant normaliser matters."""
    global COEFF
    saved, COEFF = COEFF, 0.0
    try:
        b = paper_batch(1)
        ref = original_loss(b, mixed, micro_per_rank=5)
        g_ref = torch.autograd.grad(ref, b["lp"])[0]
        ours = our_loss(b, mixed, 2, SEQS_PER_RANK)
        g_ours = torch.autograd.grad(ours, b["lp"])[0]
    finally:
        COEFF = saved
    assert float(ours) == pytest.approx(float(ref), rel=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-18)


def test_old_normaliser_was_64x_smaller():
    """The old normaliser (sum / (T_max x all sequences), ref = 1) shrinks the pg gradient by the
    original's sequences per rank (64) at the paper's layout: the defect this scale fixes."""
    b = paper_batch(2, equal_lengths=True)
    g_ref = torch.autograd.grad(original_loss(b, True, 1), b["lp"])[0]
    g_old = torch.autograd.grad(our_loss(b, True, 1, 1.0), b["lp"])[0]
    replay_free = ~b["replay"]
    ratio = g_ref[replay_free][b["mask"][replay_free]] / g_old[replay_free][b["mask"][replay_free]]
    # the entropy term's gradient is ~1e-3/(tokens) per token; the pg part dominates, so the ratio is ~64
    assert float(ratio.median()) == pytest.approx(64.0, rel=0.05)


def test_paper_preset_uses_the_original_layout_value():
    """conf/algo's default equals the paper's sequences per rank: ppo_mini_batch_size x n / 8 GPUs."""
    cfg = load_config("exgrpo_7b")
    per_rank = cfg.trainer.ppo_mini_batch_size * cfg.rollout.n / DP_PAPER
    assert cfg.algo.loss_seqs_per_rank_ref == per_rank == SEQS_PER_RANK


def test_normaliser_rejects_a_non_positive_reference():
    with pytest.raises(ValueError, match="seqs_per_rank_ref"):
        loss_normalisers(10, 2, "token_sum_constant", 8, 0.0)
    with pytest.raises(ValueError, match="entropy_microbatches_ref"):
        loss_normalisers(10, 2, "token_mean", 8, 1.0, 0.0)
