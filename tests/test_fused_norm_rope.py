"""`model.fused_norm_rope` (model/fused_ops.py): the local spec's RMSNorm and RoPE as one autograd function each.

- the functions against independent float64 formulas (values) and finite differences (`gradcheck`);
- the RoPE against megatron's own `apply_rotary_pos_emb`, padded (bshd) and packed (thd, positions restarting
  at each sequence), values and gradients in float64; bf16 RMSNorm against torch's;
- the whole model in float64, switch on vs off: logits and every parameter gradient, padded and packed;
- the production path (Policy.forward_backward, fp32) with the switch on vs off: tests/test_sequence_packing.py
  (`test_switches_give_same_loss_and_grads`), and at TP=2 / PP=2 vs TP=1 there (the switch is on by default).
"""

from __future__ import annotations

import torch

from tests.helpers.multirank import run_on_ranks


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * w


def test_rmsnorm_function_matches_formula_and_finite_differences():
    from exgrpo_megatron.model.fused_ops import RMSNormFunction

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    y = RMSNormFunction.apply(x, w, 1e-6)
    assert float((y - _rms_reference(x, w, 1e-6)).abs().max()) < 1e-14
    up = torch.randn(y.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((y * up).sum(), (x, w))
    ref = torch.autograd.grad((_rms_reference(x, w, 1e-6) * up).sum(), (x, w))
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)) < 1e-13
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), (x, w))


def test_rmsnorm_bf16_like_torch():
    from exgrpo_megatron.model.fused_ops import RMSNormFunction

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(torch.bfloat16)
    y = RMSNormFunction.apply(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    ref = _rms_reference(x.double(), w.double(), 1e-6)
    torch_err = float((torch.nn.functional.rms_norm(x, (32,), w, 1e-6).double() - ref).abs().max())
    assert float((y.double() - ref).abs().max()) <= torch_err  # the same fp32 compute, one bf16 rounding


def _rope_cases():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import transformer_config
    from exgrpo_megatron.model.fused_ops import RotaryFunction, rotary_tables

    cfg = load_config("demo_cpu", ["model=tiny_qwen2"])
    init_distributed(1, 1, seed=cfg.seed)
    tcfg = transformer_config(cfg.model, cfg.parallel)
    d = tcfg.kv_channels
    freqs = RotaryEmbedding(d, rotary_percent=1.0, rotary_base=10000)(40).double()  # [40, 1, 1, d]
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 13, 14, 40, 61], dtype=torch.int32)
    cases = {"padded [s, b, h, d]": (torch.randn(23, 3, 4, d, generator=g, dtype=torch.float64), None),
             "packed [t, 1, h, d]": (torch.randn(61, 1, 4, d, generator=g, dtype=torch.float64), cu)}
    errs = {}
    for name, (t, cu_seqlens) in cases.items():
        t.requires_grad_(True)
        up = torch.randn(t.shape, generator=g, dtype=torch.float64)
        if cu_seqlens is None:  # megatron's bshd path takes the first s frequencies, its thd path [t, h, d]
            ref = apply_rotary_pos_emb(t, freqs[:t.shape[0]], tcfg)
        else:
            ref = apply_rotary_pos_emb(t.squeeze(1), freqs, tcfg, cu_seqlens=cu_seqlens).unsqueeze(1)
        cos, signed_sin = rotary_tables(freqs, cu_seqlens, t.shape[0], torch.float64)
        got = RotaryFunction.apply(t, cos, signed_sin)
        (ref_grad,), (got_grad,) = (torch.autograd.grad((o * up).sum(), t) for o in (ref, got))
        errs[name] = max(float((got - ref).abs().max()), float((got_grad - ref_grad).abs().max()))
        errs[f"{name} gradcheck"] = 0.0 if torch.autograd.gradcheck(
            lambda a, c=cos[:5], s=signed_sin[:5]: RotaryFunction.apply(a, c, s), (t[:5].detach().requires_grad_(True),)
        ) else 1.0
    return errs


def test_rotary_function_matches_megatron_rope_float64():
    (errs,) = run_on_ranks(_rope_cases, world_size=1)
    assert len(errs) == 4, errs
    assert max(errs.values()) < 1e-13, errs


def _model_on_vs_off_float64():
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model import fused_ops
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.model.fused_ops import FusedRMSNorm, FusedRopeSelfAttention
    from exgrpo_megatron.policy.batch import collate, forward_inputs
    from tests.test_sequence_packing import _batch

    models = {}
    for on in (True, False):
        cfg = load_config("demo_cpu", ["model=tiny_qwen2", f"model.fused_norm_rope={str(on).lower()}"])
        init_distributed(1, 1, seed=cfg.seed)
        models[on] = build_gpt_model(cfg.model, cfg.parallel).double()
    models[True].load_state_dict(models[False].state_dict())
    fused_modules = {type(m) for m in models[True].modules()} & {FusedRMSNorm, FusedRopeSelfAttention}
    assert len(fused_modules) == 2 and isinstance(models[True].decoder.final_layernorm, FusedRMSNorm)
    assert not {type(m) for m in models[False].modules()} & fused_modules
    errs = {"rope_calls": 0}  # our RoPE ran (once per layer and forward), megatron's did not
    tables = fused_ops.rotary_tables

    def counted_tables(*args, **kwargs):
        errs["rope_calls"] += 1
        return tables(*args, **kwargs)

    fused_ops.rotary_tables = counted_tables
    seqs, prompts = _batch()
    for packed in (False, True):
        mb = collate(seqs, prompts, list(range(len(seqs))), packed=packed)
        out = {}
        for on, model in models.items():
            model.zero_grad()
            logits = model(**forward_inputs(mb, causal_mask=False))
            (logits.square() * mb.loss_mask[..., None].double()).sum().backward()
            out[on] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        (a, ga), (b, gb) = out[True], out[False]
        errs["packed" if packed else "padded"] = max(
            [float((a - b).abs().max())] + [float((ga[k] - v).abs().max() / v.abs().max()) for k, v in gb.items()])
    return errs


def test_model_with_fused_norm_rope_equals_unfused_float64():
    (errs,) = run_on_ranks(_model_on_vs_off_float64, world_size=1)
    assert errs.pop("rope_calls") == 2 * 2  # tiny_qwen2's 2 layers, padded and packed forwards of the fused model
    assert set(errs) == {"padded", "packed"} and max(errs.values()) < 1e-12, errs
