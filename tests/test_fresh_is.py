"""Truncated importance sampling on fresh tokens (`algo.fresh_is_cap`): the weight, the loss against an independent
float64 re-implementation, the weight's missing gradient, cap 0 = the weight-free code path bitwise, and every
variant honouring the cap."""

from __future__ import annotations

import math

import pytest
import torch

from exgrpo_megatron.algo.loss import global_loss_counts, loss_normalisers, truncated_is_weight
from exgrpo_megatron.algo.loss_metrics import declared_metrics, summarize_loss_metrics
from exgrpo_megatron.algo.policy_loss import LossBatch
from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.algo.surrogates import PPOClip
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.experience.schedule import Phase
from tests.helpers.exgrpo_loss import exgrpo_loss
from tests.test_algo_loss import T_MAX, random_batch, ref_loss

CAP = 1.5
VARIANTS = ["exgrpo", "grpo", "rloo", "dapo"]


def _build(name: str, cap: float):
    cfg = load_config("demo_cpu", [f"algo.name={name}", f"algo.fresh_is_cap={cap}"])
    return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)


def _batch(seed: int) -> dict:
    """random_batch plus the engine's log-probs `gen` of every token; exp(old - gen) spans both sides of CAP."""
    b = random_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    b["gen"] = b["old"] + 0.8 * torch.randn(b["old"].shape, generator=g, dtype=torch.float64)
    return b


def _run(b: dict, mixed: bool, mode: str, weights=None, entropy=True, lp=None, **kw):
    n_tok, n_seq = global_loss_counts(b["mask"].sum(-1).tolist())
    pg_norm, ent_norm = loss_normalisers(n_tok, n_seq, mode, T_MAX)
    extra = {} if weights is None else {"fresh_is_weights": weights}
    return exgrpo_loss(b["lp"] if lp is None else lp, b["old"], b["beh"], b["adv"], b["mask"], b["replay"],
                       b["ent"] if entropy else None, mixed_phase=mixed, entropy_coeff=0.001,
                       pg_normaliser=pg_norm, entropy_normaliser=ent_norm, **extra, **kw)


def test_weight_is_the_truncated_ratio_without_gradient():
    old = torch.tensor([0.0, -1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    gen = torch.tensor([0.0, -2.0, -1.0, -0.5 - math.log(CAP)], dtype=torch.float64, requires_grad=True)
    weight, truncated = truncated_is_weight(old, gen, CAP)
    torch.testing.assert_close(weight, torch.tensor([1.0, CAP, math.exp(-1.0), CAP], dtype=torch.float64))
    assert truncated.tolist()[:3] == [False, True, False]
    assert not weight.requires_grad
    with pytest.raises(ValueError):
        truncated_is_weight(old, gen, 0.0)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("mode", ["token_sum_constant", "token_mean"])
def test_loss_with_tis_matches_reference(mixed, mode):
    b = _batch(seed=5 + mixed)
    # the weights of every row, replayed ones included: the loss must apply them to fresh tokens only
    loss, metrics = _run(b, mixed, mode, truncated_is_weight(b["old"], b["gen"], CAP))
    ref, ref_metrics = ref_loss(b, mixed, mode, 0.001, cap=CAP)
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-12)
    assert 0 < ref_metrics["fresh_is_truncated_count"] < ref_metrics["fresh_token_count"]  # the cap binds on some
    assert bool(b["replay"].any()) and not bool(b["replay"].all())
    for key, value in ref_metrics.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-12), key
    summary = summarize_loss_metrics(declared_metrics(PPOClip.metrics, has_replay_term=True), metrics)
    n = ref_metrics["fresh_token_count"]
    assert summary["rollout/is_weight_mean"] == pytest.approx(ref_metrics["fresh_is_weight_sum"] / n, rel=1e-12)
    assert summary["rollout/is_truncated_fraction"] == pytest.approx(ref_metrics["fresh_is_truncated_count"] / n)
    plain, _ = _run(b, mixed, mode)
    assert loss.item() != plain.item()


@pytest.mark.parametrize("mixed", [False, True])
def test_weight_is_a_constant_factor_of_the_gradient(mixed):
    b = _batch(seed=7)
    lp = b["lp"].clone().requires_grad_(True)
    gen = b["gen"].clone().requires_grad_(True)
    weights = truncated_is_weight(b["old"], gen, CAP)
    loss, _ = _run(b, mixed, "token_mean", weights, entropy=False, lp=lp)
    grad_lp, grad_gen = torch.autograd.grad(loss, (lp, gen), allow_unused=True)
    assert grad_gen is None  # no gradient through the weight
    plain, _ = _run(b, mixed, "token_mean", entropy=False, lp=lp)
    (plain_grad,) = torch.autograd.grad(plain, lp)
    fresh = b["mask"] & ~b["replay"][:, None]
    expected = torch.where(fresh, weights.weight * plain_grad, plain_grad)
    torch.testing.assert_close(grad_lp, expected, rtol=1e-12, atol=1e-15)
    assert not torch.equal(grad_lp, plain_grad)


@pytest.mark.parametrize("name", VARIANTS)
def test_cap_zero_is_the_weight_free_path_bitwise(name):
    algo = _build(name, 0.0)
    b = _batch(seed=9)
    replay = b["replay"] if name == "exgrpo" else torch.zeros_like(b["replay"])
    assert algo.fresh_is_weights(b["old"], b["gen"], replay) is None
    for phase in (Phase.WARMUP, Phase.MIXED):
        lp = b["lp"].clone().requires_grad_(True)
        ent = b["ent"].clone().requires_grad_(True)
        batch = LossBatch.rows(lp, ent, b["mask"], old_logprobs=b["old"], behaviour_logprobs=b["gen"],
                               advantages=b["adv"], replay=replay)
        loss, metrics = algo.loss(batch, phase=phase, normalisers=(11.0, 13.0))
        lp0 = b["lp"].clone().requires_grad_(True)
        ent0 = b["ent"].clone().requires_grad_(True)
        beh = algo.replay_denominator_logprobs(b["old"], b["gen"], replay) if name == "exgrpo" else b["old"]
        shaping = dict(shaping_beta=algo.shaping_beta, policy_shaping=algo.policy_shaping) if name == "exgrpo" else {}
        want, _ = exgrpo_loss(lp0, b["old"], beh, b["adv"], b["mask"], replay, ent0, mixed_phase=not algo.clips(phase),
                              clip_ratio=algo.surrogate.clip.low, entropy_coeff=algo.entropy_coeff, pg_normaliser=11.0,
                              entropy_normaliser=13.0, **shaping)
        assert torch.equal(loss, want)
        grads, want_grads = torch.autograd.grad(loss, (lp, ent)), torch.autograd.grad(want, (lp0, ent0))
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
        step = algo.step_metrics({k: float(v) for k, v in metrics.items()})
        assert step["rollout/is_weight_mean"] == 0.0 and step["rollout/is_truncated_fraction"] == 0.0


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_weights_fresh_tokens_by_the_cap(name):
    b = _batch(seed=11)
    replay = b["replay"] if name == "exgrpo" else torch.zeros_like(b["replay"])
    # ExGRPO's generation log-probs are the recorded behaviour log-probs on replayed rows
    gen = torch.where(replay[:, None], b["beh"], b["gen"])
    args = dict(old_logprobs=b["old"], behaviour_logprobs=gen, advantages=b["adv"], replay=replay)
    on, off = _build(name, CAP), _build(name, 0.0)
    for phase in (Phase.WARMUP, Phase.MIXED):
        batch = LossBatch.rows(b["lp"], b["ent"], b["mask"], **args)
        loss_on, metrics = on.loss(batch, phase=phase, normalisers=(11.0, 13.0))
        loss_off, _ = off.loss(batch, phase=phase, normalisers=(11.0, 13.0))
        ref_b = dict(b, replay=replay, beh=off.replay_denominator_logprobs(b["old"], gen, replay) if name == "exgrpo"
                     else b["old"])
        n_tok = float(b["mask"].sum())
        ref, ref_metrics = ref_loss(ref_b, not on.clips(phase), "token_mean", 0.0, cap=CAP)
        ref_ent = on.entropy_coeff * float(b["ent"][b["mask"]].sum()) / 13.0
        assert float(loss_on) == pytest.approx(ref * n_tok / 11.0 - ref_ent, rel=1e-12)
        assert float(loss_on) != float(loss_off)
        step = on.step_metrics({k: float(v) for k, v in metrics.items()})
        n = ref_metrics["fresh_token_count"]
        assert step["rollout/is_weight_mean"] == pytest.approx(ref_metrics["fresh_is_weight_sum"] / n, rel=1e-12)
        assert step["rollout/is_truncated_fraction"] == pytest.approx(ref_metrics["fresh_is_truncated_count"] / n)
        assert 0 < step["rollout/is_truncated_fraction"] < 1


def test_exgrpo_replayed_rows_keep_their_loss_under_the_cap():
    b = _batch(seed=13)
    replay = torch.ones_like(b["replay"])  # every row replayed: its generation log-probs are pi_past, not weighted
    batch = LossBatch.rows(b["lp"], b["ent"], b["mask"], old_logprobs=b["old"], behaviour_logprobs=b["beh"],
                           advantages=b["adv"], replay=replay)
    loss_on, metrics = _build("exgrpo", CAP).loss(batch, phase=Phase.MIXED, normalisers=(11.0, 13.0))
    loss_off, _ = _build("exgrpo", 0.0).loss(batch, phase=Phase.MIXED, normalisers=(11.0, 13.0))
    assert torch.equal(loss_on, loss_off) and float(metrics["fresh_is_truncated_count"]) == 0.0
