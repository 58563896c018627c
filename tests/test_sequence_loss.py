"""Sequence-level losses see their sequences under padding and packing alike: GSPO (algo.name=gspo) and ExGRPO
with GSPO's ratio on its fresh tokens (algo.ratio=sequence) against independent float64 references written per
sequence, on the real micro-batches (policy/batch.py: right-padded and packed) of a linear "logits = x @ W" model at
DP=2; a per-row mean planted in place of the sequence index passes the padded check and fails the packed one.
Also: the sequence index of collate, the reduction helper, the asymmetric clip, the sequence-mean aggregation and the
declared step metrics."""

from __future__ import annotations

import math

import pytest
import torch

from exgrpo_megatron.algo.loss import Clip, clipped_surrogate
from exgrpo_megatron.algo.loss_metrics import summarize_loss_metrics
from exgrpo_megatron.algo.policy_loss import LossBatch
from exgrpo_megatron.algo.registry import build_algorithm
from exgrpo_megatron.algo.sequences import Sequences
from exgrpo_megatron.algo.surrogates import PPOClip
from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.experience.schedule import Phase
from exgrpo_megatron.policy.batch import collate, make_micro_batches
from tests.helpers.multirank import run_on_ranks

CLIP_LOW, CLIP_HIGH = 0.05, 0.08  # narrow enough that some sequences' ratios are clipped, some not
BETA = 0.1
MAX_TOKENS = 16  # several sequences per packed row, several micro-batches per rank
ARMS = {  # name: (overrides, phase)
    "gspo": (("algo.name=gspo",), Phase.WARMUP),
    "exgrpo_seq_warmup": (("algo.name=exgrpo", "algo.ratio=sequence"), Phase.WARMUP),
    "exgrpo_seq_mixed": (("algo.name=exgrpo", "algo.ratio=sequence"), Phase.MIXED),
}


def _algorithm(overrides: tuple[str, ...]):
    shaping = [f"algo.settings.shaping_beta={BETA}"] if "algo.name=exgrpo" in overrides else []  # ExGRPO's setting
    cfg = load_config("demo_cpu", [*overrides, f"algo.clip_ratio={CLIP_LOW}", f"algo.clip_ratio_high={CLIP_HIGH}",
                                   *shaping, "algo.fresh_is_cap=0"])
    return build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)


def problem(seed: int = 6, n: int = 9, hidden: int = 4, vocab: int = 6, step: float = 0.05) -> dict:
    """n sequences (prompt + response token ids; the ids only set lengths), per response token a feature x and a
    target y; pi_old from W0, the current policy W; rows 2 and 5 replayed with recorded log-probs `beh`."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 4, (n,), generator=g).tolist()
    rlens = [1, 6, 3, 5, 2, 4, 6, 1, 3][:n]
    w0 = torch.randn(hidden, vocab, generator=g, dtype=torch.float64)
    xs = [torch.randn(r, hidden, generator=g, dtype=torch.float64) for r in rlens]
    ys = [torch.randint(0, vocab, (r,), generator=g) for r in rlens]
    old = [torch.log_softmax(x @ w0, -1).gather(-1, y[:, None])[:, 0] for x, y in zip(xs, ys, strict=True)]
    return dict(sequences=[list(range(p + r)) for p, r in zip(plens, rlens, strict=True)], plens=plens,
                rlens=rlens, xs=xs, ys=ys, old=old,
                beh=[o + 0.5 * torch.randn(o.shape, generator=g, dtype=torch.float64) for o in old],
                adv=torch.randn(n, generator=g, dtype=torch.float64).tolist(),
                replay=[i in (2, 5) for i in range(n)],
                w=w0 + step * torch.randn(hidden, vocab, generator=g, dtype=torch.float64))


# ------------------------------------------------------------------------------ independent float64 references
def reference(p: dict, arm: str, w: torch.Tensor) -> torch.Tensor:
    """The full batch's loss, sequence by sequence (no micro-batch, no layout). GSPO: 1/N sum_i max(-A s_i,
    -A clip(s_i)), s_i = exp(mean_t log(pi_w / pi_old)) (the sequence-level objective itself, not its token form).
    ExGRPO + sequence ratio: token sum over T_max x N / S_ref of |y_i| x that surrogate on fresh sequences (unclipped
    in the mixed phase) and -A f(w_t) on replayed tokens, w_t = pi_w / pi_behaviour, f(w) = w / (w + beta)."""
    algo = _algorithm(ARMS[arm][0])
    n = len(p["rlens"])
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        logp = torch.log_softmax(p["xs"][i] @ w, -1).gather(-1, p["ys"][i][:, None])[:, 0]
        a = p["adv"][i]
        if arm != "gspo" and p["replay"][i]:
            ratio = torch.exp(logp - p["beh"][i])
            total = total + (-a * ratio / (ratio + BETA)).sum()
            continue
        s = torch.exp((logp - p["old"][i]).mean())
        surrogate = -a * s
        if arm != "exgrpo_seq_mixed":
            surrogate = torch.maximum(surrogate, -a * torch.clamp(s, 1 - CLIP_LOW, 1 + CLIP_HIGH))
        total = total + (surrogate if arm == "gspo" else len(logp) * surrogate)
    if arm == "gspo":
        return total / n
    return total / (algo.max_response_length * n / algo.loss_seqs_per_rank_ref)


def reference_loss_grad(p: dict, arm: str) -> tuple[float, torch.Tensor, list[bool]]:
    """(loss, dloss/dW, which sequences the clip binds on: the clipped branch is the larger) of the reference."""
    w = p["w"].clone().requires_grad_(True)
    loss = reference(p, arm, w)
    loss.backward()
    clipped = []
    with torch.no_grad():
        for i in range(len(p["rlens"])):
            logp = torch.log_softmax(p["xs"][i] @ p["w"], -1).gather(-1, p["ys"][i][:, None])[:, 0]
            s, a = math.exp(float((logp - p["old"][i]).mean())), p["adv"][i]
            clipped.append(-a * min(max(s, 1 - CLIP_LOW), 1 + CLIP_HIGH) > -a * s)
    return float(loss), w.grad, clipped


# ------------------------------------------------------------------------------ the code under test, per rank
def micro_batch_loss_batch(p: dict, mb, w: torch.Tensor, per_row_planted: bool) -> LossBatch:
    """The loss inputs of one real micro-batch (collate's layout: loss_mask targets in row-major order, the rows in
    order); `per_row_planted`: the planted bug, each row taken for one sequence."""
    mask = mb.loss_mask.bool()
    x = torch.zeros(*mask.shape, p["w"].shape[0], dtype=torch.float64)
    y = torch.zeros(mask.shape, dtype=torch.long)
    x[mask] = torch.cat([p["xs"][i] for i in mb.rows])
    y[mask] = torch.cat([p["ys"][i] for i in mb.rows])
    logp = torch.log_softmax(x @ w, -1).gather(-1, y[..., None])[..., 0]
    per_token = [torch.full((n,), float(v), dtype=torch.float64) for n, v in zip(p["rlens"], p["adv"], strict=True)]
    replay = [torch.full((n,), float(r)) for n, r in zip(p["rlens"], p["replay"], strict=True)]
    f64 = torch.float64
    sequences = Sequences.rows(mb.loss_mask) if per_row_planted else mb.sequences
    return LossBatch(logp, None, mb.loss_mask, mb.place(p["old"], f64), mb.place(p["beh"], f64),
                     mb.place(per_token, f64), mb.place(replay, f64), sequences)


def _dp2_worker(p: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.distributed.runtime import init_distributed

    layout = init_distributed(tensor_model_parallel_size=1)
    dp_group = ps.get_data_parallel_group()
    rows = list(range(len(p["rlens"])))[layout.dp_rank::layout.dp_size]  # uneven tokens per rank
    out: dict = {"dp_size": layout.dp_size}
    for arm, (overrides, phase) in ARMS.items():
        algo = _algorithm(overrides)
        if arm == "gspo":
            rows_here = [i for i in rows if not p["replay"][i]]  # on-policy: no replayed rows
        else:
            rows_here = rows
        counts = global_loss_counts([p["rlens"][i] for i in rows_here], dp_group)
        normalisers = algo.normalisers(*counts)
        for packed in (False, True):
            for planted in (False, True):
                w = p["w"].clone().requires_grad_(True)
                loss_sum, n_mb, seqs_per_row = 0.0, 0, 0
                for mb in make_micro_batches(p["sequences"], p["plens"], rows_here, MAX_TOKENS, packed):
                    loss, _ = algo.loss(micro_batch_loss_batch(p, mb, w, planted), phase=phase,
                                        normalisers=normalisers)
                    loss.backward()
                    loss_sum += float(loss)
                    n_mb += 1
                    seqs_per_row = max(seqs_per_row, len(mb.rows) // mb.tokens.shape[0])
                grad = w.grad.clone()
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=dp_group)  # sum over DP (the normaliser's contract)
                total = torch.tensor([loss_sum], dtype=torch.float64)
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
                out[(arm, packed, planted)] = (float(total), grad, n_mb, seqs_per_row)
    return out


def _gspo_problem(p: dict) -> dict:
    """GSPO is on-policy: the same problem without its replayed rows."""
    keep = [i for i, r in enumerate(p["replay"]) if not r]
    return {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in p.items()}


@pytest.fixture(scope="module")
def dp2() -> tuple[dict, dict]:
    p = problem()
    got = run_on_ranks(_dp2_worker, world_size=2, args=(p,))
    assert [r["dp_size"] for r in got] == [2, 2]
    return p, got[0]


@pytest.mark.parametrize("arm", list(ARMS))
def test_sequence_ratio_equals_the_float64_reference_padded_and_packed_at_dp2(dp2, arm):
    p, got = dp2
    ref_p = _gspo_problem(p) if arm == "gspo" else p
    ref_loss, ref_grad, clipped = reference_loss_grad(ref_p, arm)
    if arm != "exgrpo_seq_mixed":  # the clip binds on some sequences, not all
        fresh = [c for c, r in zip(clipped, ref_p["replay"], strict=True) if not r]
        assert any(fresh) and not all(fresh), clipped
    assert ref_grad.abs().sum() > 0
    # the packed layout can tell a per-row ratio from a per-sequence one: rows of >= 2 sequences, one unclipped
    rows = [i for i in range(len(p["rlens"])) if arm != "gspo" or not p["replay"][i]]
    unclipped = {i: not c for i, c in zip(rows, clipped, strict=True)}
    per_rank = [[i for i in range(len(p["rlens"]))[r::2] if i in unclipped] for r in (0, 1)]  # as _dp2_worker
    sensitive = [mb.rows for mine in per_rank for mb in make_micro_batches(p["sequences"], p["plens"], mine,
                                                                           MAX_TOKENS, True)
                 if len(mb.rows) >= 2 and any(unclipped[i] for i in mb.rows)]
    assert len(sensitive) >= 2, sensitive
    for packed in (False, True):
        loss, grad, n_mb, seqs_per_row = got[(arm, packed, False)]
        assert n_mb >= 2 and (seqs_per_row >= 2 if packed else seqs_per_row == 1), (n_mb, seqs_per_row)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-15), (arm, packed)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("arm", list(ARMS))
def test_a_per_row_mean_passes_padded_and_fails_packed(dp2, arm):
    """The planted bug (each row taken for one sequence, what a loss that ignores the sequence index computes):
    identical on a padded batch, wrong as soon as a packed row holds several sequences."""
    p, got = dp2
    ref_loss, ref_grad, _ = reference_loss_grad(_gspo_problem(p) if arm == "gspo" else p, arm)
    loss, grad, _, _ = got[(arm, False, True)]
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-14)
    loss, grad, _, _ = got[(arm, True, True)]
    assert loss != pytest.approx(ref_loss, rel=1e-6) or not torch.allclose(grad, ref_grad, rtol=1e-6)


# ------------------------------------------------------------------------------ the parts
def test_collate_names_each_targets_sequence_padded_and_packed():
    seqs, plens = [[7] * 5, [8] * 3, [9] * 6], [2, 1, 4]
    for packed in (False, True):
        mb = collate(seqs, plens, [2, 0, 1], packed=packed)
        idx = mb.sequences.index
        assert mb.sequences.count == 3
        assert torch.equal(idx >= 0, mb.loss_mask.bool())
        for b, i in enumerate(mb.rows):
            assert int((idx == b).sum()) == len(seqs[i]) - plens[i]
            r, c = mb.row_start(b)
            p, n = plens[i], len(seqs[i])
            assert bool((idx[r, c + p - 1:c + n - 1] == b).all())


def test_sequence_sums_means_and_broadcast_against_python():
    index = torch.tensor([[0, 0, -1, 1, 1, 1, -1, 2]])
    values = torch.tensor([[1.0, 3.0, 100.0, 2.0, 4.0, 6.0, 100.0, 5.0]], dtype=torch.float64)
    s = Sequences(index, 4)  # sequence 3 has no token
    assert s.sums(values).tolist() == [4.0, 12.0, 5.0, 0.0]
    assert s.means(values).tolist() == [2.0, 4.0, 5.0, 0.0]
    assert s.token_counts().tolist() == [2.0, 3.0, 1.0, 0.0]
    where = torch.tensor([[True, False, True, True, True, False, True, True]])
    assert s.means(values, where).tolist() == [1.0, 3.0, 5.0, 0.0]
    assert s.to_tokens(torch.tensor([10.0, 20.0, 30.0, 40.0])).tolist() == [[10, 10, 0, 20, 20, 20, 0, 30]]


def test_asymmetric_clip_is_dapos_clip_higher():
    log_ratio = torch.log(torch.tensor([0.5, 0.9, 1.1, 1.25, 1.5], dtype=torch.float64))
    for adv in (1.0, -1.0):
        loss, clipped = clipped_surrogate(log_ratio, torch.full((5,), adv, dtype=torch.float64), Clip(0.2, 0.28))
        for r, got, was in zip(log_ratio.exp().tolist(), loss.tolist(), clipped.tolist(), strict=True):
            want = max(-adv * r, -adv * min(max(r, 0.8), 1.28))
            assert got == pytest.approx(want, rel=1e-15) and was == (-adv * min(max(r, 0.8), 1.28) > -adv * r)
    cfg = load_config("demo_cpu", ["algo.name=dapo", "algo.clip_ratio_high=0.28"])
    algo = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    spec = algo.loss_spec(Phase.WARMUP)
    assert spec.surrogate == PPOClip(Clip(0.2, 0.28)) and spec.trust_region
    cfg = load_config("demo_cpu", ["algo.name=dapo"])
    assert build_algorithm(cfg.algo, cfg.trainer, 8).loss_spec(Phase.WARMUP).surrogate == PPOClip(Clip(0.2, 0.2))


def test_a_loss_without_a_replay_term_declares_no_replay_metric():
    gspo, exgrpo = _algorithm(("algo.name=gspo",)), _algorithm(("algo.name=exgrpo",))
    p = _gspo_problem(problem())
    mb = collate(p["sequences"], p["plens"], list(range(len(p["rlens"]))), packed=True)
    _, metrics = gspo.loss(micro_batch_loss_batch(p, mb, p["w"], False), phase=Phase.WARMUP, normalisers=(3.0, 5.0))
    assert not any(k.startswith("replay") for k in metrics)
    step = gspo.step_metrics({k: float(v) for k, v in metrics.items()})
    assert not any(k.startswith("replay/") for k in step) and step["loss/policy"] == float(metrics["pg_loss"])
    assert {m.name for m in exgrpo.declared_metrics} - {m.name for m in gspo.declared_metrics} == {
        "replay/is_weight_mean", "replay/is_weight_max", "replay/shaped_weight_mean", "replay/token_fraction"}
    with pytest.raises(KeyError, match="replay_"):  # a declared metric the loss did not return
        summarize_loss_metrics(exgrpo.declared_metrics, {k: float(v) for k, v in metrics.items()})
    assert gspo.step_metrics({}) == {m.name: 0.0 for m in gspo.declared_metrics}  # no update ran
