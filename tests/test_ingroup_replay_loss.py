"""In-group replay end to end below the model: a response store filled over two steps (unequally per rank), a step's
fresh groups enlarged by their questions' stored responses (rollout/stored_responses.py), the rows and advantages
(policy/train_batch.py), the real micro-batches (padded and packed) and `algo.name=ingroup_replay`'s loss on a
bigram linear model, logits = E[token] @ W in float64 -- at DP=1 and at DP=2 with unequal groups and unequal stores
per rank, against an independent float64 reference written from the definitions:

    group q: K fresh rewards + the r_q newest stored ones (r_q <= r, newest step first, generated order within it);
    A = reward - mean over the K + r_q rows (Dr.GRPO);
    fresh token: max(-A rho, -A clip(rho, 1 - eps, 1 + eps)), rho = pi_W / pi_old;
    replayed token: the same x u, u = min(pi_old / pi_recorded, C) (recorded: the stored behaviour log-probs);
    summed over the batch / (T_max x sequences / S_ref).

The reference with advantages over the fresh rows only, or with u against pi_old (u = 1), differs from the code's
result (each checked here), so either bug fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.multirank import run_on_ranks

V, H, K, R = 16, 4, 3, 3
CLIP, CAP = 0.1, 1.5
MAX_TOKENS = 24  # several sequences per packed row, several micro-batches
QIDS = list(range(7))
OVERRIDES = ["algo.name=ingroup_replay", f"algo.clip_ratio={CLIP}", f"algo.settings.replay_tis_cap={CAP}",
             "algo.fresh_is_cap=0", f"experience.ingroup_size={R}"]


def problem(seed: int = 3) -> dict:
    """History (steps 1, 2: {qid: [(ids, recorded logprobs, reward)]}; question 2 never seen, 4 seen once with 1
    response) and the current step's fresh groups; E, W0 (pi_old) and W (the current policy)."""
    g = np.random.default_rng(seed)

    def responses(n: int) -> list[tuple[list[int], list[float], float]]:
        out = []
        for _ in range(n):
            m = int(g.integers(1, 7))
            out.append((g.integers(0, V, m).tolist(), g.normal(-2.5, 0.6, m).astype(np.float32).tolist(),
                        float(g.integers(0, 2))))
        return out

    history = {1: {0: responses(3), 1: responses(3), 3: responses(3), 5: responses(2), 6: responses(3)},
               2: {0: responses(3), 3: responses(1), 4: responses(1), 6: responses(3)}}
    fresh = {q: responses(K) for q in QIDS}
    fresh[5] = [(ids, lps, 0.0) for ids, lps, _ in fresh[5]]  # an all-fail group with a stored success or not
    t = torch.Generator().manual_seed(seed)
    w0 = torch.randn(H, V, generator=t, dtype=torch.float64)
    return dict(history=history, fresh=fresh, prompts={q: [q % V, (3 * q + 1) % V, 5] for q in QIDS},
                e=torch.randn(V, H, generator=t, dtype=torch.float64), w0=w0,
                w=w0 + 0.25 * torch.randn(H, V, generator=t, dtype=torch.float64))


def token_logprobs(p: dict, w: torch.Tensor, prompt: list[int], ids: list[int]) -> torch.Tensor:
    seq = prompt + ids
    x = p["e"][torch.tensor(seq[len(prompt) - 1:-1])]
    return torch.log_softmax(x @ w, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


# ------------------------------------------------------------------------------ independent float64 reference
def reference_groups(p: dict) -> dict[int, list[tuple[list[int], list[float], float, bool]]]:
    """Each question's enlarged group: (ids, behaviour logprobs, reward, replayed)."""
    out = {}
    for q in QIDS:
        stored = [r for step in sorted(p["history"], reverse=True) for r in p["history"][step].get(q, [])][:R]
        out[q] = [(*r, False) for r in p["fresh"][q]] + [(*r, True) for r in stored]
    return out


def reference(p: dict, w: torch.Tensor, max_response_length: int, planted: str = "") -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    groups = reference_groups(p)
    n_seqs = sum(len(v) for v in groups.values())
    for q, rows in groups.items():
        rewards = [r[2] for r in rows]
        baseline = np.mean([r[2] for r in rows if not r[3]]) if planted == "fresh_only" else np.mean(rewards)
        for ids, beh, reward, replayed in rows:
            a = float(np.float32(reward - baseline))  # the rows' advantages are placed in float32
            old = token_logprobs(p, p["w0"], p["prompts"][q], ids).float().double()
            rho = torch.exp(token_logprobs(p, w, p["prompts"][q], ids) - old)
            loss = torch.maximum(-a * rho, -a * torch.clamp(rho, 1 - CLIP, 1 + CLIP))
            if replayed and planted != "tis_vs_pi_old":
                loss = loss * torch.clamp(torch.exp(old - torch.tensor(beh, dtype=torch.float64)), max=CAP)
            total = total + loss.sum()
    return total / (max_response_length * n_seqs / 1.0)  # demo_cpu: algo.loss_seqs_per_rank_ref=1


def reference_loss_grad(p: dict, max_response_length: int, planted: str = "") -> tuple[float, torch.Tensor]:
    w = p["w"].clone().requires_grad_(True)
    loss = reference(p, w, max_response_length, planted)
    loss.backward()
    return float(loss), w.grad


# ------------------------------------------------------------------------------ the code under test, per rank
def _worker(p: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.algo.policy_loss import LossBatch
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.data.step_plan import QuestionGroup
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.experience.response_store import ResponseStore
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.train_batch import TrainBatch, build_rollout_rows, micro_batches_for_update
    from exgrpo_megatron.rollout.group_filter import StepRollouts
    from exgrpo_megatron.rollout.stored_responses import stored_outcomes, with_stored_responses
    from exgrpo_megatron.rollout.types import Sample

    layout = init_distributed(tensor_model_parallel_size=1)
    rank, size = layout.dp_rank, layout.dp_size
    dp_group = ps.get_data_parallel_group_gloo() if size > 1 else None
    cfg = load_config("demo_cpu", OVERRIDES)
    algo = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    store = ResponseStore(algo.response_replay(cfg.experience), cfg.experience.max_age_steps, dp_group)

    def rollouts(groups: dict) -> StepRollouts:
        qs = list(groups)
        return StepRollouts.unfiltered([QuestionGroup(q, p["prompts"][q], "") for q in qs],
                                       [[Sample(p["prompts"][q], ids, lps, "stop") for ids, lps, _ in groups[q]]
                                        for q in qs], [[x for _, _, x in groups[q]] for q in qs])

    for step, groups in p["history"].items():  # rank 0 generated the first 3 groups of a step, rank 1 the rest
        qs = list(groups)
        mine = qs[:3] if rank == 0 else qs[3:]
        store.update(stored_outcomes(rollouts({q: groups[q] for q in (mine if size > 1 else qs)}), step))
        store.expire(step)
    mine = QIDS[rank::size]  # 4 and 3 groups
    enlarged = with_stored_responses(store, rollouts({q: p["fresh"][q] for q in mine}))
    rows = build_rollout_rows(enlarged.samples, enlarged.rewards, algo.advantages)
    old = [token_logprobs(p, p["w0"], s[:n], s[n:]).float()
           for s, n in zip(rows.sequences, rows.prompt_lengths, strict=True)]
    batch = TrainBatch.of(rows, old)
    out: dict = {"dp_size": size, "store": store.num_responses,
                 "rows": [(mine[g], tuple(s), rep, a) for s, rep, a, g in zip(
                     rows.sequences, rows.is_replay, rows.advantages, rows.group_index, strict=True)]}
    counts = global_loss_counts(rows.response_lengths, dp_group)
    normalisers = algo.normalisers(*counts)
    for packed in (False, True):
        w = p["w"].clone().requires_grad_(True)
        loss_sum, n_mb, seqs_per_row = 0.0, 0, 0
        for mb in micro_batches_for_update(batch, list(range(len(rows.sequences))), MAX_TOKENS, packed):
            li = mb.loss_inputs
            logp = torch.log_softmax(p["e"][mb.tokens] @ w, -1).gather(-1, mb.labels[..., None])[..., 0]
            lb = LossBatch(logp, None, mb.loss_mask, li.old_logprobs.double(), li.behaviour_logprobs.double(),
                           li.advantages.double(), li.replay, mb.sequences)
            loss, _ = algo.loss(lb, phase=Phase.WARMUP, normalisers=normalisers)
            loss.backward()
            loss_sum += float(loss)
            n_mb += 1
            seqs_per_row = max(seqs_per_row, len(mb.rows) // mb.tokens.shape[0])
        grad = w.grad.clone()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        if dp_group is not None:
            dist.all_reduce(grad, group=dp_group)
            dist.all_reduce(total, group=dp_group)
        out[packed] = (float(total), grad, n_mb, seqs_per_row)
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict], list[dict]]:
    p = problem()
    return p, run_on_ranks(_worker, 1, args=(p,)), run_on_ranks(_worker, 2, args=(p,))


def test_enlarged_groups_and_their_advantages_match_the_reference_at_dp1_and_dp2(runs):
    p, dp1, dp2 = runs
    assert [r["dp_size"] for r in dp2] == [2, 2] and 0 < dp2[0]["store"] != dp2[1]["store"]  # unequal stores
    want = {}
    for q, rows in reference_groups(p).items():
        mean = np.mean([r[2] for r in rows])
        want[q] = [(tuple(p["prompts"][q] + ids), replayed, reward - mean) for ids, _, reward, replayed in rows]
    assert {len(v) - K for v in want.values()} == {0, 1, 2, 3}  # r_q differs per question, up to r
    for got in (dp1[0]["rows"], dp2[0]["rows"] + dp2[1]["rows"]):
        by_q: dict = {}
        for q, seq, rep, a in got:
            by_q.setdefault(q, []).append((seq, rep, a))
        assert sorted(by_q) == QIDS
        for q in QIDS:
            assert [(s, r) for s, r, _ in by_q[q]] == [(s, r) for s, r, _ in want[q]], q
            assert [a for _, _, a in by_q[q]] == pytest.approx([a for _, _, a in want[q]], rel=1e-12, abs=1e-15)
    assert len(dp2[0]["rows"]) != len(dp2[1]["rows"])


def test_the_loss_equals_the_reference_padded_and_packed_at_dp1_and_dp2(runs):
    p, dp1, dp2 = runs
    from exgrpo_megatron.config.loader import load_config

    t_max = load_config("demo_cpu", OVERRIDES).data.max_response_length
    ref_loss, ref_grad = reference_loss_grad(p, t_max)
    assert ref_grad.abs().sum() > 0
    for got in (dp1[0], dp2[0]):
        for packed in (False, True):
            loss, grad, n_mb, seqs_per_row = got[packed]
            assert n_mb >= 2 and (seqs_per_row >= 2 if packed else seqs_per_row == 1), (n_mb, seqs_per_row)
            assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-15), (got["dp_size"], packed)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-11, atol=1e-14)
    for planted in ("fresh_only", "tis_vs_pi_old"):  # the batch tells each bug apart from the code
        bad_loss, bad_grad = reference_loss_grad(p, t_max, planted)
        assert not torch.allclose(bad_grad, ref_grad, rtol=1e-6), planted


def test_the_batch_exercises_the_clip_and_the_cap():
    """Some fresh ratios are clipped and some not; some replayed tokens' weights are capped and some not."""
    p = problem()
    rho, u = [], []
    for q, rows in reference_groups(p).items():
        for ids, beh, _, replayed in rows:
            old = token_logprobs(p, p["w0"], p["prompts"][q], ids).float().double()
            rho += torch.exp(token_logprobs(p, p["w"], p["prompts"][q], ids) - old).tolist()
            if replayed:
                u += torch.exp(old - torch.tensor(beh, dtype=torch.float64)).tolist()
    assert any(abs(x - 1) > CLIP for x in rho) and any(abs(x - 1) < CLIP for x in rho)
    assert any(x > CAP for x in u) and any(x < CAP for x in u)
