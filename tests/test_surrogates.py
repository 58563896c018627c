"""Surrogates chosen by the spec (algo/surrogates.py), each against an independent float64 reference written per
token from its paper's definition, on the real micro-batches (policy/batch.py: right-padded and packed) of a linear
"logits = x @ W" model at DP=2 with unequal tokens per rank:

* CISPO (`algo.name=cispo`, MiniMax-M1): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta, token mean;
* ExGRPO with CISPO's surrogate and the truncated-IS replay term (`algo.surrogate=cispo
  algo.settings.replay_tis_cap>0`) in the mixed phase: replayed tokens take CISPO's loss x min(pi_old / pi_recorded,
  cap) -- the reference with PPO's surrogate on replayed tokens differs, so the test fails if the replay term applies
  PPO's;
* GRPO with the k3 KL penalty against pi_old (`algo.name=grpo_kl`, DeepSeekMath Eq. 3-4).

Also: each surrogate's metrics under its own name."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.policy.batch import collate, make_micro_batches
from tests.helpers.multirank import run_on_ranks
from tests.test_sequence_loss import MAX_TOKENS, _gspo_problem, micro_batch_loss_batch, problem

EPS_LOW, EPS_HIGH = 0.03, 0.04  # CISPO's bounds: narrow enough that some tokens' weights are capped, some not
PPO_EPS = 0.04
TIS_CAP = 1.5
KL_COEF = 0.3
ARMS = {  # name: (overrides, phase, on-policy)
    "cispo": (("algo.name=cispo", f"algo.settings.cispo_eps_low={EPS_LOW}", f"algo.settings.cispo_eps_high={EPS_HIGH}"),
              Phase.WARMUP, True),
    "exgrpo_cispo_tis": (("algo.name=exgrpo", "algo.surrogate=cispo", f"algo.settings.cispo_eps_low={EPS_LOW}",
                          f"algo.settings.cispo_eps_high={EPS_HIGH}", "algo.settings.policy_shaping=false",
                          f"algo.settings.replay_tis_cap={TIS_CAP}"), Phase.MIXED, False),
    "grpo_kl": (("algo.name=grpo_kl", f"algo.clip_ratio={PPO_EPS}", f"algo.settings.kl_coef={KL_COEF}"),
                Phase.WARMUP, True),
}


def _algorithm(arm: str):
    cfg = load_config("demo_cpu", [*ARMS[arm][0], "algo.fresh_is_cap=0"])
    return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)


# ------------------------------------------------------------------------------ independent float64 references
def reference(p: dict, arm: str, w: torch.Tensor, replay_surrogate: str = "cispo") -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss value, a function of W whose gradient is the loss's) of the full batch, token by token.

    CISPO (MiniMax-M1 Eq. 4): J = 1/sum_i |o_i| sum_{i,t} sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_i log pi(o_t);
    its gradient is that of -J; its value here is -sum w A / tokens (the code's, with the same gradient).
    ExGRPO + CISPO + truncated IS (mixed phase): the same per-token CISPO term on fresh tokens, and on replayed tokens
    x u = min(pi_old / pi_recorded, cap); summed over T_max x N / S_ref. `replay_surrogate="ppo"`: what PPO's
    (unclipped in the mixed phase) surrogate would give on replayed tokens instead: -u A r.
    GRPO + KL: sum_t max(-A r, -A clip(r, 1 - eps, 1 + eps)) + beta (pi_old / pi - log(pi_old / pi) - 1), over
    T_max x N / S_ref."""
    algo = _algorithm(arm)
    value = torch.zeros((), dtype=torch.float64)
    surrogate = torch.zeros((), dtype=torch.float64)
    n_tokens = sum(p["rlens"])
    for i in range(len(p["rlens"])):
        logp = torch.log_softmax(p["xs"][i] @ w, -1).gather(-1, p["ys"][i][:, None])[:, 0]
        a, old = p["adv"][i], p["old"][i]
        r = torch.exp(logp - old)
        if arm == "grpo_kl":
            ppo = torch.maximum(-a * r, -a * torch.clamp(r, 1 - PPO_EPS, 1 + PPO_EPS))
            k3 = torch.exp(old - logp) - (old - logp) - 1
            value = value + (ppo + KL_COEF * k3).sum()
            surrogate = surrogate + (ppo + KL_COEF * k3).sum()
            continue
        weight = torch.clamp(r.detach(), 1 - EPS_LOW, 1 + EPS_HIGH)
        u = torch.ones_like(r)
        if p["replay"][i]:
            u = torch.clamp(torch.exp(old - p["beh"][i]), max=TIS_CAP)
            if replay_surrogate == "ppo":
                value = value + (-u * a * r).sum()
                surrogate = surrogate + (-u * a * r).sum()
                continue
        value = value + (-u * weight * a).sum()
        surrogate = surrogate + (-u * weight * a * logp).sum()
    t_max_sequences = algo.max_response_length * len(p["rlens"]) / algo.loss_seqs_per_rank_ref
    normaliser = n_tokens if arm == "cispo" else t_max_sequences
    return value / normaliser, surrogate / normaliser


def reference_loss_grad(p: dict, arm: str, replay_surrogate: str = "cispo") -> tuple[float, torch.Tensor]:
    w = p["w"].clone().requires_grad_(True)
    value, surrogate = reference(p, arm, w, replay_surrogate)
    surrogate.backward()
    return float(value), w.grad


def capped_weights(p: dict) -> list[bool]:
    """Per token of the batch (sequence order): is its CISPO weight capped by a bound?"""
    out = []
    for i in range(len(p["rlens"])):
        logp = torch.log_softmax(p["xs"][i] @ p["w"], -1).gather(-1, p["ys"][i][:, None])[:, 0]
        r = torch.exp(logp - p["old"][i])
        out += ((r < 1 - EPS_LOW) | (r > 1 + EPS_HIGH)).tolist()
    return out


# ------------------------------------------------------------------------------ the code under test, per rank
def _dp2_worker(p: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.distributed.runtime import init_distributed

    layout = init_distributed(tensor_model_parallel_size=1)
    dp_group = ps.get_data_parallel_group()
    rows = list(range(len(p["rlens"])))[layout.dp_rank::layout.dp_size]  # uneven tokens per rank
    out: dict = {"dp_size": layout.dp_size}
    for arm, (_, phase, on_policy) in ARMS.items():
        algo = _algorithm(arm)
        rows_here = [i for i in rows if not (on_policy and p["replay"][i])]
        normalisers = algo.normalisers(*global_loss_counts([p["rlens"][i] for i in rows_here], dp_group))
        for packed in (False, True):
            w = p["w"].clone().requires_grad_(True)
            loss_sum, n_mb, seqs_per_row = 0.0, 0, 0
            for mb in make_micro_batches(p["sequences"], p["plens"], rows_here, MAX_TOKENS, packed):
                loss, _ = algo.loss(micro_batch_loss_batch(p, mb, w, False), phase=phase, normalisers=normalisers)
                loss.backward()
                loss_sum += float(loss)
                n_mb += 1
                seqs_per_row = max(seqs_per_row, len(mb.rows) // mb.tokens.shape[0])
            grad = w.grad.clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=dp_group)
            total = torch.tensor([loss_sum], dtype=torch.float64)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
            out[(arm, packed)] = (float(total), grad, n_mb, seqs_per_row)
    return out


@pytest.fixture(scope="module")
def dp2() -> tuple[dict, dict]:
    p = problem()
    got = run_on_ranks(_dp2_worker, world_size=2, args=(p,))
    assert [r["dp_size"] for r in got] == [2, 2]
    return p, got[0]


@pytest.mark.parametrize("arm", list(ARMS))
def test_surrogate_equals_the_float64_reference_padded_and_packed_at_dp2(dp2, arm):
    p, got = dp2
    ref_p = _gspo_problem(p) if ARMS[arm][2] else p
    ref_loss, ref_grad = reference_loss_grad(ref_p, arm)
    capped = capped_weights(ref_p)
    assert any(capped) and not all(capped), capped  # the bounds bind on some tokens, not all
    assert ref_grad.abs().sum() > 0
    for packed in (False, True):
        loss, grad, n_mb, seqs_per_row = got[(arm, packed)]
        assert n_mb >= 2 and (seqs_per_row >= 2 if packed else seqs_per_row == 1), (n_mb, seqs_per_row)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-15), (arm, packed)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-14)


def test_the_replay_term_applies_cispo_not_ppo(dp2):
    """The batch tells the two apart: PPO's surrogate on the replayed tokens gives another loss and gradient, and the
    code's equal CISPO's (the previous test), so a replay term calling PPO's clipped surrogate fails there."""
    p, got = dp2
    assert any(p["replay"])
    cispo_loss, cispo_grad = reference_loss_grad(p, "exgrpo_cispo_tis")
    ppo_loss, ppo_grad = reference_loss_grad(p, "exgrpo_cispo_tis", replay_surrogate="ppo")
    assert not torch.allclose(cispo_grad, ppo_grad, rtol=1e-6)
    loss, grad, _, _ = got[("exgrpo_cispo_tis", True)]
    assert not torch.allclose(grad, ppo_grad, rtol=1e-6) and loss != pytest.approx(ppo_loss, rel=1e-6)


def test_each_surrogate_logs_its_own_metrics():
    """CISPO's capped-weight fraction is its own metric (not PPO's loss/clip_fraction, which means tokens whose
    gradient the clip drops); GRPO + KL logs PPO's clip fraction and its penalty; no on-policy variant logs replay/*."""
    p = _gspo_problem(problem())
    mb = collate(p["sequences"], p["plens"], list(range(len(p["rlens"]))), packed=True)
    for arm, metric in (("cispo", "loss/cispo_weight_clip_fraction"), ("grpo_kl", "loss/kl_penalty")):
        algo = _algorithm(arm)
        _, metrics = algo.loss(micro_batch_loss_batch(p, mb, p["w"], False), phase=Phase.WARMUP,
                               normalisers=(3.0, 5.0))
        step = algo.step_metrics({k: float(v) for k, v in metrics.items()})
        assert metric in step and not any(k.startswith("replay/") for k in step), step
        assert all(m.meaning for m in algo.declared_metrics)
        if arm == "cispo":
            capped = capped_weights(p)
            assert "loss/clip_fraction" not in step
            assert step[metric] == pytest.approx(sum(capped) / len(capped), rel=1e-12)
        else:
            assert "loss/clip_fraction" in step
            k3 = []
            for i in range(len(p["rlens"])):
                logp = torch.log_softmax(p["xs"][i] @ p["w"], -1).gather(-1, p["ys"][i][:, None])[:, 0]
                k3 += (torch.exp(p["old"][i] - logp) - (p["old"][i] - logp) - 1).tolist()
            assert step[metric] == pytest.approx(sum(k3) / len(k3), rel=1e-12)
