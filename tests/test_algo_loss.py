"""Advantages and the ExGRPO loss against independent float64 reference formulas; aggregation invariance
over micro-batches and DP ranks on a small linear "logits = x @ W" model."""

from __future__ import annotations

import math

import pytest
import torch

from exgrpo_megatron.algo.advantages import group_advantages
from exgrpo_megatron.algo.loss import (
    global_loss_counts,
    loss_normalisers,
    mult_prob_error_sums,
    select_replay_denominator_logprobs,
    shaped_ratio,
)
from exgrpo_megatron.algo.loss_metrics import declared_metrics, summarize_loss_metrics
from exgrpo_megatron.algo.surrogates import PPOClip
from exgrpo_megatron.policy.logprobs import vocab_parallel_logprobs_entropy
from tests.helpers.exgrpo_loss import exgrpo_loss
from tests.helpers.multirank import run_on_ranks

T_MAX = 16


# ---------------------------------------------------------------- independent float64 references
def ref_advantages(rewards: list[list[float]], std_normalize: bool, eps: float) -> list[list[float]]:
    out = []
    for group in rewards:
        k = len(group)
        mean = sum(group) / k
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (k - 1))
        out.append([(r - mean) / (std + eps) if std_normalize else r - mean for r in group])
    return out


def ref_token_loss(lp, old, beh, adv, is_replay, mixed, eps=0.2, beta=0.1) -> tuple[float, bool]:
    if is_replay:
        w = math.exp(lp - beh)
        return -adv * w / (w + beta), False
    rho = math.exp(lp - old)
    if mixed:
        return -adv * rho, False
    clipped = -adv * min(max(rho, 1 - eps), 1 + eps)
    return max(-adv * rho, clipped), clipped > -adv * rho


def ref_loss(b: dict, mixed: bool, mode: str, coeff: float, cap: float = 0.0) -> tuple[float, dict]:
    """float64, token by token. `cap` > 0: fresh tokens' loss x min(exp(old - gen), cap) (truncated IS, `b["gen"]`
    the engine's log-probs), with its two metrics; replayed tokens unweighted."""
    n_tok = int(b["mask"].sum())
    n_seq = int((b["mask"].sum(1) > 0).sum())
    pg_norm = T_MAX * n_seq if mode == "token_sum_constant" else n_tok
    pg = ent = kl = wsum = fsum = v_sum = 0.0
    clipped = n_fresh = n_replay = n_trunc = 0
    wmax = 0.0
    for i in range(b["lp"].shape[0]):
        for t in range(b["lp"].shape[1]):
            if not b["mask"][i, t]:
                continue
            lp, old, beh = float(b["lp"][i, t]), float(b["old"][i, t]), float(b["beh"][i, t])
            replay = bool(b["replay"][i])
            loss_t, was_clipped = ref_token_loss(lp, old, beh, float(b["adv"][i]), replay, mixed)
            if cap > 0 and not replay:
                ratio = math.exp(old - float(b["gen"][i, t]))
                v = min(ratio, cap)
                loss_t *= v
                v_sum, n_trunc = v_sum + v, n_trunc + (ratio > cap)
            pg += loss_t
            ent += float(b["ent"][i, t])
            if replay:
                n_replay += 1
                w = math.exp(lp - beh)
                wsum, wmax, fsum = wsum + w, max(wmax, w), fsum + w / (w + 0.1)
            else:
                n_fresh += 1
                clipped += was_clipped
                kl += math.exp(lp - old) - 1 - (lp - old)
    loss = pg / pg_norm - coeff * ent / n_tok
    metrics = dict(clipped_token_count=clipped, fresh_token_count=n_fresh, replay_token_count=n_replay,
                   replay_weight_sum=wsum, replay_weight_max=wmax, replay_shaped_weight_sum=fsum,
                   entropy_sum=ent, approx_kl_sum=kl, token_count=n_tok)
    if cap > 0:
        metrics.update(fresh_is_weight_sum=v_sum, fresh_is_truncated_count=n_trunc)
    return loss, metrics


def random_batch(seed: int, b: int = 6, t: int = 9) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    return dict(
        lp=old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64),
        old=old,
        beh=old + 0.8 * torch.randn(b, t, generator=g, dtype=torch.float64),
        adv=torch.randn(b, generator=g, dtype=torch.float64),
        mask=mask,
        replay=torch.tensor([i % 3 == 0 for i in range(b)]),
        ent=torch.rand(b, t, generator=g, dtype=torch.float64) * 2,
    )


def run_loss(b: dict, mixed: bool, mode: str, coeff: float = 0.001, **overrides):
    n_tok, n_seq = global_loss_counts(b["mask"].sum(-1).tolist())
    pg_norm, ent_norm = loss_normalisers(n_tok, n_seq, mode, T_MAX)
    kw = dict(mixed_phase=mixed, clip_ratio=0.2, shaping_beta=0.1, entropy_coeff=coeff,
              pg_normaliser=pg_norm, entropy_normaliser=ent_norm)
    kw.update(overrides)
    return exgrpo_loss(b["lp"], b["old"], b["beh"], b["adv"], b["mask"], b["replay"], b["ent"], **kw)


# ---------------------------------------------------------------- advantages
@pytest.mark.parametrize("std_normalize", [False, True])
def test_group_advantages_match_reference(std_normalize):
    rewards = torch.randint(0, 2, (5, 8)).double()
    rewards[0] = torch.rand(8, dtype=torch.float64)  # non-binary rewards too
    expected = torch.tensor(ref_advantages(rewards.tolist(), std_normalize, 1e-6), dtype=torch.float64)
    got = group_advantages(rewards, std_normalize=std_normalize)
    torch.testing.assert_close(got, expected)
    flat = group_advantages(rewards.flatten(), group_size=8, std_normalize=std_normalize)
    torch.testing.assert_close(flat, expected.flatten())


@pytest.mark.parametrize("k", [1, 3, 7, 8])
def test_replay_in_mixed_group_gets_one_minus_k_over_k(k):
    rewards = torch.tensor([[1.0] + [1.0] * (k - 1) + [0.0] * (8 - k)])  # replay first, k successes in total
    adv = group_advantages(rewards)
    assert adv[0, 0].item() == pytest.approx(1 - k / 8)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(10), group_size=3)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 8), group_size=4)


# ---------------------------------------------------------------- per-token pieces
def test_shaped_ratio_is_w_over_w_plus_beta_and_stays_finite():
    log_w = torch.linspace(-8, 8, 33, dtype=torch.float64, requires_grad=True)
    w = log_w.detach().exp()
    f = shaped_ratio(log_w, 0.1)
    torch.testing.assert_close(f.detach(), w / (w + 0.1))
    f.sum().backward()
    torch.testing.assert_close(log_w.grad, w * 0.1 / (w + 0.1) ** 2)  # df/dlog w = w * beta / (w+beta)^2
    assert torch.isfinite(shaped_ratio(torch.tensor([1e4, -1e4]), 0.1)).all()


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("mode", ["token_sum_constant", "token_mean"])
def test_exgrpo_loss_matches_reference(mixed, mode):
    b = random_batch(seed=1 + mixed)
    loss, metrics = run_loss(b, mixed, mode)
    ref, ref_metrics = ref_loss(b, mixed, mode, 0.001)
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-12)
    for key, value in ref_metrics.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-12, abs=1e-12), key
    if not mixed:
        assert ref_metrics["clipped_token_count"] > 0  # the batch exercises the clip
    else:
        assert metrics["clipped_token_count"].item() == 0
    summary = summarize_loss_metrics(declared_metrics(PPOClip.metrics, has_replay_term=True), metrics)
    assert summary["entropy/mean"] == pytest.approx(ref_metrics["entropy_sum"] / ref_metrics["token_count"])
    assert summary["replay/is_weight_max"] == pytest.approx(ref_metrics["replay_weight_max"])


def test_warmup_clip_zeroes_gradient_and_mixed_phase_does_not():
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    b = dict(lp=lp, old=old, beh=old, adv=torch.tensor([2.0], dtype=torch.float64),
             mask=torch.ones(1, 2, dtype=torch.bool), replay=torch.tensor([False]), ent=None)
    loss, _ = run_loss(b, mixed=False, mode="token_mean")
    (grad,) = torch.autograd.grad(loss, lp)
    # A > 0: rho = 1.5 is clipped (zero grad); rho = 0.5 lies below 1 - eps, where min() keeps the unclipped term.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2.0 * 0.5 / 2]], dtype=torch.float64))
    loss, _ = run_loss(b, mixed=True, mode="token_mean")
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.tensor([[-2.0 * 1.5 / 2, -2.0 * 0.5 / 2]], dtype=torch.float64))


@pytest.mark.parametrize("mixed", [False, True])
def test_gradcheck_exgrpo_loss(mixed):
    b = random_batch(seed=3, b=4, t=5)
    lp = b["lp"].clone().requires_grad_(True)
    ent = b["ent"].clone().requires_grad_(True)

    def fn(lp_, ent_):
        return exgrpo_loss(lp_, b["old"], b["beh"], b["adv"], b["mask"], b["replay"], ent_, mixed_phase=mixed,
                           entropy_coeff=0.3, pg_normaliser=7.0, entropy_normaliser=5.0)[0]

    assert torch.autograd.gradcheck(fn, (lp, ent))


def test_padding_values_outside_mask_are_harmless():
    b = random_batch(seed=4)
    clean, _ = run_loss(b, mixed=True, mode="token_mean")
    noisy = dict(b, lp=torch.where(b["mask"], b["lp"], torch.full_like(b["lp"], 1e4)))
    noisy_loss, metrics = run_loss(noisy, mixed=True, mode="token_mean")
    assert noisy_loss.item() == clean.item()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_loss_normalisers_and_counts():
    assert global_loss_counts([2, 3]) == (5.0, 2.0)  # response lengths of the rows
    assert loss_normalisers(5, 2, "token_sum_constant", 8192) == (8192 * 2, 5)
    assert loss_normalisers(5, 2, "token_mean", 8192) == (5, 5)
    assert loss_normalisers(0, 0, "token_mean", 8192) == (1, 1)
    assert loss_normalisers(5, 2, "seq_mean", 8192) == (2, 5)
    with pytest.raises(ValueError):
        loss_normalisers(5, 2, "sequence_sum", 8192)


def test_select_replay_denominator_logprobs():
    old, rec = torch.zeros(2, 3), torch.full((2, 3), -1.0)
    replay = torch.tensor([True, False])
    expected = torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    select = select_replay_denominator_logprobs
    torch.testing.assert_close(select(old, rec, replay, replay_is_correction=True), expected)
    torch.testing.assert_close(select(old, rec, replay, replay_is_correction=False), old)


def test_mult_prob_error_sums():
    """The terms of mismatch/token_mult_prob_error: the sum of exp|logp_behaviour - logp_trainer| over the valid
    tokens and their count."""
    gen = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    train = torch.tensor([[-1.1, -2.0, 50.0], [-0.2, 9.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    expected = (math.exp(0.1) + 1.0 + math.exp(0.3)) / 3
    total, count = mult_prob_error_sums(gen, train, mask)
    assert count.item() == 3 and (total / count).item() == pytest.approx(expected)


# ---------------------------------------------------------------- aggregation invariance (linear model)
def linear_problem(seed: int = 7, b: int = 8, t: int = 6, hidden: int = 5, vocab: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(hidden, vocab, generator=g, dtype=torch.float64)
    x = torch.randn(b, t, hidden, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.tensor([1, 6, 3, 5, 2, 6, 4, 1])[:b]
    with torch.no_grad():
        old, _ = vocab_parallel_logprobs_entropy(x @ w0, targets)
    return dict(w0=w0, x=x, targets=targets, old=old, beh=old + 0.5 * torch.randn(b, t, generator=g),
                adv=torch.randn(b, generator=g, dtype=torch.float64),
                mask=torch.arange(t)[None, :] < lengths[:, None], replay=torch.arange(b) % 4 == 1,
                w=w0 + 0.3 * torch.randn(hidden, vocab, generator=g, dtype=torch.float64))


def micro_batch_loss(p: dict, w: torch.Tensor, rows, mixed: bool, norms: tuple[float, float]) -> torch.Tensor:
    logp, ent = vocab_parallel_logprobs_entropy(p["x"][rows] @ w, p["targets"][rows], chunk_size=5)
    loss, _ = exgrpo_loss(logp, p["old"][rows], p["beh"][rows], p["adv"][rows], p["mask"][rows], p["replay"][rows],
                          ent, mixed_phase=mixed, entropy_coeff=0.05, pg_normaliser=norms[0],
                          entropy_normaliser=norms[1])
    return loss


def accumulated_grad(p: dict, rows: torch.Tensor, n_micro: int, mixed: bool, norms) -> tuple[float, torch.Tensor]:
    w = p["w"].clone().requires_grad_(True)
    total = 0.0
    for chunk in torch.tensor_split(rows, n_micro):
        loss = micro_batch_loss(p, w, chunk, mixed, norms)
        loss.backward()
        total += loss.item()
    return total, w.grad


@pytest.mark.parametrize("mode", ["token_sum_constant", "token_mean"])
@pytest.mark.parametrize("mixed", [False, True])
def test_gradient_equal_for_1_and_4_micro_batches(mode, mixed):
    p = linear_problem()
    norms = loss_normalisers(*global_loss_counts(p["mask"].sum(-1).tolist()), mode, T_MAX)
    rows = torch.arange(p["x"].shape[0])
    loss_1, grad_1 = accumulated_grad(p, rows, 1, mixed, norms)
    loss_4, grad_4 = accumulated_grad(p, rows, 4, mixed, norms)
    assert loss_4 == pytest.approx(loss_1, rel=1e-12)
    torch.testing.assert_close(grad_4, grad_1, rtol=1e-12, atol=1e-14)
    assert grad_1.abs().sum() > 0
    # The contract matters: per-micro-batch token means (the classic bug) would give a different gradient.
    if mode == "token_mean":
        w = p["w"].clone().requires_grad_(True)
        for chunk in torch.tensor_split(rows, 4):
            local = loss_normalisers(*global_loss_counts(p["mask"][chunk].sum(-1).tolist()), mode, T_MAX)
            (micro_batch_loss(p, w, chunk, mixed, local) / 4).backward()
        assert not torch.allclose(w.grad, grad_1, rtol=1e-6)


def _dp2_worker(p: dict, modes: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.distributed.runtime import init_distributed

    layout = init_distributed(tensor_model_parallel_size=1)
    dp_group = ps.get_data_parallel_group()
    rows = torch.arange(p["x"].shape[0])[layout.dp_rank::layout.dp_size]  # uneven token counts per rank
    out = {"dp_size": layout.dp_size}
    for mode in modes:
        norms = loss_normalisers(*global_loss_counts(p["mask"][rows].sum(-1).tolist(), dp_group), mode, T_MAX)
        loss, grad = accumulated_grad(p, rows, 2, True, norms)
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=dp_group)  # sum, not average, over DP
        out[mode] = (loss, grad)
    return out


def test_gradient_equal_for_dp1_and_dp2():
    p = linear_problem(seed=11)
    modes = ["token_sum_constant", "token_mean"]
    results = run_on_ranks(_dp2_worker, world_size=2, args=(p, modes))
    assert [r["dp_size"] for r in results] == [2, 2]
    for mode in modes:
        norms = loss_normalisers(*global_loss_counts(p["mask"].sum(-1).tolist()), mode, T_MAX)
        full_loss, full_grad = accumulated_grad(p, torch.arange(p["x"].shape[0]), 1, True, norms)
        assert sum(r[mode][0] for r in results) == pytest.approx(full_loss, rel=1e-12)
        for r in results:
            torch.testing.assert_close(r[mode][1], full_grad, rtol=1e-12, atol=1e-14)
