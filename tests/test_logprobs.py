"""Fused vocab-parallel log-prob + entropy against an independent float64 full-vocabulary reference."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.policy.logprobs import vocab_parallel_logprobs_entropy
from tests.helpers.multirank import run_on_ranks


def reference_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """float64: logp_t = log softmax(z/T)[target], H = -sum p log p over the full vocabulary."""
    z = logits.double() / temperature
    log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return logp, entropy


def mixed_loss(logp, entropy, w_logp, w_ent):
    """A loss mixing log-probs and entropy with random per-token weights, so both gradients matter."""
    return (w_logp * logp).sum() + (w_ent * entropy).sum()


def _problem(seed: int, shape=(3, 7), vocab: int = 12, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, vocab, shape, generator=g)
    w_logp = torch.randn(shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(shape, generator=g, dtype=torch.float64)
    return logits, targets, w_logp, w_ent


def _reference_grad(logits, targets, w_logp, w_ent, temperature, with_entropy_grad=True):
    x = logits.double().clone().requires_grad_(True)
    logp, ent = reference_logprobs_entropy(x, targets, temperature)
    loss = mixed_loss(logp, ent, w_logp, w_ent) if with_entropy_grad else (w_logp * logp).sum()
    loss.backward()
    return logp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("temperature,chunk_size", [(1.0, 4), (0.7, 1), (1.3, 1024)])
def test_tp1_matches_reference_values_and_grads_fp32(temperature, chunk_size):
    logits64, targets, w_logp, w_ent = _problem(0)
    logits = logits64.float().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=chunk_size, temperature=temperature)
    mixed_loss(logp, ent, w_logp.float(), w_ent.float()).backward()
    ref_logp, ref_ent, ref_grad = _reference_grad(logits64.float(), targets, w_logp, w_ent, temperature)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, atol=1e-5, rtol=1e-5)


def test_chunk_grad_in_row_blocks_matches_reference():
    """A chunk of more rows than GRAD_BLOCK_ROWS (and not a multiple of it): chunk_grad's entropy-gradient branch
    runs block by block over the rows of its one buffer; every block's gradient must match the float64 reference."""
    from exgrpo_megatron.policy.logprobs import GRAD_BLOCK_ROWS

    logits64, targets, w_logp, w_ent = _problem(5, shape=(3, GRAD_BLOCK_ROWS + 5))
    logits = logits64.float().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=1024, temperature=0.8)
    mixed_loss(logp, ent, w_logp.float(), w_ent.float()).backward()
    _, _, ref_grad = _reference_grad(logits64.float(), targets, w_logp, w_ent, 0.8)
    torch.testing.assert_close(logits.grad.double(), ref_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_float64(temperature):
    logits, targets, _, _ = _problem(1, shape=(2, 3), vocab=6)
    x = logits.clone().requires_grad_(True)
    fn = lambda z: vocab_parallel_logprobs_entropy(z, targets, chunk_size=4, temperature=temperature)
    assert torch.autograd.gradcheck(fn, (x,))
    fn_logp_only = lambda z: vocab_parallel_logprobs_entropy(z, targets, chunk_size=2, entropy_grad=False)[0]
    assert torch.autograd.gradcheck(fn_logp_only, (x,))


def test_input_logits_are_not_modified():
    logits64, targets, w_logp, w_ent = _problem(2)
    logits = logits64.float().requires_grad_(True)
    before = logits.detach().clone()
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=5)  # T=1: the aliasing-prone path
    mixed_loss(logp, ent, w_logp.float(), w_ent.float()).backward()
    assert torch.equal(logits.detach(), before)


def test_entropy_grad_false_and_without_entropy():
    logits64, targets, w_logp, _ = _problem(3)
    ref_logp, ref_ent, ref_grad = _reference_grad(logits64, targets, w_logp, w_logp, 0.9, with_entropy_grad=False)

    x = logits64.clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(x, targets, chunk_size=3, temperature=0.9, entropy_grad=False)
    assert not ent.requires_grad and logp.requires_grad
    torch.testing.assert_close(ent, ref_ent)
    (w_logp * logp).sum().backward()
    torch.testing.assert_close(x.grad, ref_grad)

    y = logits64.clone().requires_grad_(True)
    logp2, none_ent = vocab_parallel_logprobs_entropy(y, targets, chunk_size=3, temperature=0.9, with_entropy=False)
    assert none_ent is None
    torch.testing.assert_close(logp2.detach(), ref_logp)
    (w_logp * logp2).sum().backward()
    torch.testing.assert_close(y.grad, ref_grad)


def test_bf16_logits_compute_in_fp32_and_return_bf16_grad():
    logits64, targets, w_logp, w_ent = _problem(4)
    logits = logits64.bfloat16().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, chunk_size=4)
    assert logp.dtype == torch.float32
    mixed_loss(logp, ent, w_logp.float(), w_ent.float()).backward()
    assert logits.grad.dtype == torch.bfloat16
    # Reference on the same (bf16-rounded) values, so only the fp32 compute and the bf16 grad cast differ.
    ref_logp, ref_ent, ref_grad = _reference_grad(logits.detach().double(), targets, w_logp, w_ent, 1.0)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_grad, atol=2e-2, rtol=1e-2)


def _tp2_worker(full_logits: torch.Tensor, targets: torch.Tensor, w_logp, w_ent) -> dict:
    from exgrpo_megatron.distributed.runtime import init_distributed

    layout = init_distributed(tensor_model_parallel_size=2)
    vocab_local = full_logits.shape[-1] // layout.tp_size
    shard = full_logits[..., layout.tp_rank * vocab_local:(layout.tp_rank + 1) * vocab_local]
    out = {"tp_rank": layout.tp_rank, "tp_size": layout.tp_size}
    cases = {"t1_chunk3": dict(temperature=1.0, chunk_size=3), "t06_chunk1": dict(temperature=0.6, chunk_size=1)}
    for name, kw in cases.items():
        x = shard.float().clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs_entropy(x, targets, **kw)  # tp_group=None -> megatron's TP group
        mixed_loss(logp, ent, w_logp.float(), w_ent.float()).backward()
        out[name] = (logp.detach(), ent.detach(), x.grad.clone())
    x = shard.clone().requires_grad_(True)  # float64, logp only, entropy not differentiable
    logp, ent = vocab_parallel_logprobs_entropy(x, targets, chunk_size=2, entropy_grad=False)
    (w_logp * logp).sum().backward()
    out["logp_only_f64"] = (logp.detach(), ent.detach(), x.grad.clone())
    return out


def test_tp2_matches_tp1_and_full_vocab_reference():
    full_logits, targets, w_logp, w_ent = _problem(5, shape=(2, 5), vocab=16)
    results = run_on_ranks(_tp2_worker, world_size=2, args=(full_logits, targets, w_logp, w_ent))
    assert [r["tp_rank"] for r in results] == [0, 1] and all(r["tp_size"] == 2 for r in results)
    vocab_local = full_logits.shape[-1] // 2
    for name, temperature in [("t1_chunk3", 1.0), ("t06_chunk1", 0.6)]:
        ref_logp, ref_ent, ref_grad = _reference_grad(full_logits.float(), targets, w_logp, w_ent, temperature)
        tp1 = full_logits.float().clone().requires_grad_(True)
        tp1_logp, tp1_ent = vocab_parallel_logprobs_entropy(tp1, targets, temperature=temperature)
        mixed_loss(tp1_logp, tp1_ent, w_logp.float(), w_ent.float()).backward()
        for r in results:
            logp, ent, grad_shard = r[name]
            torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logp, tp1_logp.detach(), atol=1e-6, rtol=1e-6)
            own = slice(r["tp_rank"] * vocab_local, (r["tp_rank"] + 1) * vocab_local)
            torch.testing.assert_close(grad_shard.double(), ref_grad[..., own], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(grad_shard, tp1.grad[..., own], atol=1e-6, rtol=1e-6)
    ref_logp, ref_ent, ref_grad = _reference_grad(full_logits, targets, w_logp, w_ent, 1.0, with_entropy_grad=False)
    for r in results:
        logp, ent, grad_shard = r["logp_only_f64"]
        torch.testing.assert_close(logp, ref_logp)
        torch.testing.assert_close(ent, ref_ent)
        own = slice(r["tp_rank"] * vocab_local, (r["tp_rank"] + 1) * vocab_local)
        torch.testing.assert_close(grad_shard, ref_grad[..., own])
