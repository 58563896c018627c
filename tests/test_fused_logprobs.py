"""The output layer fused into the chunked log-prob/entropy (`policy/fused_logprobs.py`, `policy/output_layer.py`):
against an independent float64 reference, against the unfused path (logits, then the chunked kernel), at TP=2 vs
TP=1 on gloo ranks, and in a real megatron policy: `trainer.fused_output_logprobs` on == off (loss, log-probs,
entropies and every parameter's gradient, tied and untied embeddings)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exgrpo_megatron.policy.fused_logprobs import fused_output_logprobs_entropy
from exgrpo_megatron.policy.logprobs import vocab_parallel_logprobs_entropy
from exgrpo_megatron.rollout.sampling import mask_padded_vocab
from tests.helpers.multirank import run_on_ranks


def _problem(seed: int, n: int = 11, hidden: int = 6, vocab: int = 16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    return h, w, g


def _targets(g, n: int, vocab_size: int):
    return torch.randint(0, vocab_size, (n,), generator=g)


def _weights(g, n: int):
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def reference(h, w, targets, vocab_size: int, temperature: float, w_logp, w_ent):
    """float64, full vocabulary: z = h W^T / T over the first vocab_size ids only (padded ids have no
    probability); logp = log softmax(z)[target], H = -sum p log p; loss = sum w_l logp + w_H H."""
    h = h.double().clone().requires_grad_(True)
    w = w.double().clone().requires_grad_(True)
    z = (h @ w[:vocab_size].t()) / temperature
    log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
    logp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _fused(h, w, targets, vocab_size, temperature, chunk, w_logp, w_ent, dtype=torch.float32):
    h = h.to(dtype).clone().requires_grad_(True)
    w = w.to(dtype).clone().requires_grad_(True)
    logp, ent = fused_output_logprobs_entropy(h, w, targets, vocab_size, chunk_size=chunk, temperature=temperature)
    ((w_logp.to(dtype) * logp).sum() + (w_ent.to(dtype) * ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature,chunk,vocab_size", [(1.0, 4, 16), (0.7, 1, 13), (1.3, 256, 9)])
def test_fused_matches_float64_reference(temperature, chunk, vocab_size):
    h, w, g = _problem(0)
    targets = _targets(g, h.shape[0], vocab_size)
    w_logp, w_ent = _weights(g, h.shape[0])
    ref = reference(h, w, targets, vocab_size, temperature, w_logp, w_ent)
    got = _fused(h, w, targets, vocab_size, temperature, chunk, w_logp, w_ent)
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref, strict=True):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.all(got[3][vocab_size:] == 0)  # padded vocabulary rows get no gradient


def test_gradcheck_float64():
    h, w, g = _problem(1, n=5, hidden=3, vocab=7)
    targets = _targets(g, 5, 6)
    for temperature, entropy_grad in ((0.8, True), (1.0, False)):
        def fn(h_, w_, temperature=temperature, entropy_grad=entropy_grad):
            logp, ent = fused_output_logprobs_entropy(h_, w_, targets, 6, chunk_size=2, temperature=temperature,
                                                      entropy_grad=entropy_grad)
            return (logp, ent) if entropy_grad else logp
        assert torch.autograd.gradcheck(fn, (h.clone().requires_grad_(True), w.clone().requires_grad_(True)))


def test_fused_equals_logits_then_chunked_kernel_fp32():
    """The switch at kernel level: fused == megatron-style logits (masked padding) + the chunked kernel."""
    h, w, g = _problem(2, n=23, hidden=8, vocab=32)
    targets = _targets(g, 23, 29)
    w_logp, w_ent = _weights(g, 23)
    fused = _fused(h, w, targets, 29, 0.9, 5, w_logp, w_ent)
    hf, wf = h.float().requires_grad_(True), w.float().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(mask_padded_vocab(hf @ wf.t(), 29), targets, temperature=0.9)
    ((w_logp.float() * logp).sum() + (w_ent.float() * ent).sum()).backward()
    for a, b in zip(fused, (logp.detach(), ent.detach(), hf.grad, wf.grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_arguments_fail_clearly():
    h, w, g = _problem(3)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_output_logprobs_entropy(h, w, _targets(g, 11, 16), 16, chunk_size=0)
    with pytest.raises(ValueError, match="targets shape"):
        fused_output_logprobs_entropy(h, w, _targets(g, 10, 16), 16)


def _tp2_kernel_worker(h, w, targets, vocab_size, w_logp, w_ent) -> dict:
    from exgrpo_megatron.distributed.runtime import init_distributed

    layout = init_distributed(tensor_model_parallel_size=2)
    rows = w.shape[0] // 2
    shard = w[layout.tp_rank * rows:(layout.tp_rank + 1) * rows]
    out = {"tp_rank": layout.tp_rank}
    for temperature, chunk in ((1.0, 3), (0.6, 64)):
        out[temperature] = _fused(h, shard, targets, vocab_size, temperature, chunk, w_logp, w_ent)
    return out


def test_tp2_matches_tp1_and_reference():
    h, w, g = _problem(4, n=9, hidden=5, vocab=16)
    vocab_size = 13  # rank 1's shard holds 3 padded rows
    targets = _targets(g, 9, vocab_size)
    w_logp, w_ent = _weights(g, 9)
    results = run_on_ranks(_tp2_kernel_worker, world_size=2, args=(h, w, targets, vocab_size, w_logp, w_ent))
    for temperature in (1.0, 0.6):
        tp1 = _fused(h, w, targets, vocab_size, temperature, 4, w_logp, w_ent)
        ref = reference(h, w, targets, vocab_size, temperature, w_logp, w_ent)
        for r in results:
            logp, ent, grad_h, grad_w_shard = r[temperature]
            own = slice(r["tp_rank"] * 8, (r["tp_rank"] + 1) * 8)
            for a, b, c in ((logp, tp1[0], ref[0]), (ent, tp1[1], ref[1]), (grad_h, tp1[2], ref[2]),
                            (grad_w_shard, tp1[3][own], ref[3][own])):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(a.double(), c, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the switch in a real megatron policy
def _policy_run(model_name: str, tp: int) -> dict:
    """One policy; the same micro-batches through token_stats (old log-probs / scoring) and the ExGRPO loss with
    the fused output layer on and off. Returns per mode the stats, the loss and every parameter's gradient."""
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch, micro_batches_for_update, token_stats
    from tests.helpers.gather import full_tensors

    cfg = load_config("demo_cpu", [f"model={model_name}", "model.vocab_size=120",  # 8 padded vocabulary ids
                                   f"parallel.tensor_model_parallel_size={tp}"])
    init_distributed(tp, 1, seed=cfg.seed)
    policy = Policy(cfg)
    g = torch.Generator().manual_seed(7)
    lengths, prompts = [14, 9, 17, 6, 11], [5, 3, 6, 2, 4]
    seqs = [torch.randint(0, 120, (n,), generator=g).tolist() for n in lengths]
    n_resp = [n - p for n, p in zip(lengths, prompts, strict=True)]
    rows = RolloutRows(seqs, prompts, [torch.randn(k, generator=g) - 2 for k in n_resp], [0.0] * 5,
                       torch.randn(5, generator=g).tolist(), [False, True, False, True, False], [0, 0, 1, 1, 2])
    out = {}
    output_layer_calls = []
    for module in policy.modules:
        module.output_layer.register_forward_hook(lambda *_: output_layer_calls.append(1))
    for fused in (False, True):
        output_layer_calls.clear()
        policy.fused_output_logprobs = fused
        policy.eval()
        logp, ent, _ = token_stats(policy, seqs, prompts, site="test", temperature=0.7, with_entropy=True,
                                   max_tokens=40)
        old = [lp + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(i)) for i, lp in
               enumerate(logp)]
        mbs = micro_batches_for_update(TrainBatch.of(rows, old), list(range(5)), max_tokens=40)
        algorithm = build_algorithm(replace(cfg.algo, entropy_coeff=0.01), cfg.trainer, cfg.data.max_response_length)
        loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=(float(sum(n_resp)), float(sum(n_resp))),
                             temperature=0.7, vocab_size=cfg.model.vocab_size)
        policy.train()
        policy.zero_grad()
        metrics = policy.forward_backward(mbs, loss_fn, site="test")
        loss = float(sum(m["pg_loss"] - m["entropy_bonus"] for m in metrics))
        out[fused] = {"logp": logp, "entropy": ent, "loss": loss, "output_layer_calls": len(output_layer_calls),
                      "n_micro": len(mbs), "grads": full_tensors(policy.modules, "grad")}
    return out


def _assert_switch_exact(run: dict) -> None:
    off, on = run[False], run[True]
    assert off["n_micro"] > 1
    assert on["output_layer_calls"] == 0 and off["output_layer_calls"] > 0  # the switch really bypasses the layer
    for a, b in zip(on["logp"] + on["entropy"], off["logp"] + off["entropy"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert abs(on["loss"] - off["loss"]) <= 1e-5 * max(1.0, abs(off["loss"])), (on["loss"], off["loss"])
    assert set(on["grads"]) == set(off["grads"])
    for name, ref in off["grads"].items():
        assert ref.abs().max() > 0, name  # every parameter takes part, the output weight included
        torch.testing.assert_close(on["grads"][name], ref, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama"])  # untied / tied embeddings
def test_policy_switch_on_equals_off(model_name):
    _assert_switch_exact(run_on_ranks(_policy_run, world_size=1, args=(model_name, 1))[0])


def test_policy_switch_on_equals_off_tp2():
    for r in run_on_ranks(_policy_run, world_size=2, args=("tiny_llama", 2)):
        _assert_switch_exact(r)
