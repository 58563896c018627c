"""Sequence packing (`trainer.sequence_packing`) and the sdpa core attention (`model.core_attention`):
the switched-on paths give the same per-token values, loss and gradients as the switched-off ones.

- planning / collation (pure): packed micro-batches hold every row once within the budget, with the same
  tokens and per-token values (`MicroBatch.place`) as the padded ones, and `scatter_rows` inverts both;
- float64: the padded and the packed model forward both equal each sequence run on its own (the
  reference: no padding, no neighbours), logits and parameter gradients;
- the production path (`Policy.forward_backward`, fp32): packed vs padded, sdpa vs megatron attention and
  `model.fused_norm_rope` on vs off, loss and every gradient; packed at TP=2 and PP=2 vs TP=1 (spawned gloo ranks).
"""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.policy.batch import collate, make_micro_batches, plan_micro_batches, scatter_rows
from tests.helpers.gather import full_tensors
from tests.helpers.multirank import run_on_ranks


def _batch(n: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 18, (n,), generator=g).tolist()
    prompts = [int(torch.randint(2, n_ - 2, (1,), generator=g)) for n_ in lengths]
    seqs = [torch.randint(0, 128, (n_,), generator=g).tolist() for n_ in lengths]
    return seqs, prompts


def test_packed_plan_fits_budget_and_covers_rows():
    lengths = [9, 3, 17, 8, 8, 2, 12, 30]
    plan = plan_micro_batches(lengths, 32, packed=True)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 32 for mb in plan)
    assert len(plan) == 3  # first-fit decreasing: 30+2, 17+12+3, 9+8+8
    assert plan_micro_batches([40, 5], 32, packed=True) == [[0], [1]]  # an over-budget row alone


def test_packed_collate_places_rows_like_padded():
    seqs, prompts = _batch()
    per_token = {"adv": [torch.arange(len(s) - p, dtype=torch.float32) + 10 * i
                         for i, (s, p) in enumerate(zip(seqs, prompts, strict=True))]}
    rows = [4, 0, 6, 2]
    padded = collate(seqs, prompts, rows)
    packed = collate(seqs, prompts, rows, packed=True)
    padded_adv, packed_adv = padded.place(per_token["adv"]), packed.place(per_token["adv"])
    lengths = [len(seqs[i]) for i in rows]
    assert packed.tokens.shape == (1, sum(lengths)) and packed.padding_tokens == 0
    assert padded.padding_tokens == len(rows) * max(lengths) - sum(lengths)
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed.num_tokens == padded.num_tokens
    for b, n in enumerate(lengths):
        c = int(packed.cu_seqlens[b])
        assert torch.equal(packed.tokens[0, c:c + n], padded.tokens[b, :n])
        assert torch.equal(packed.loss_mask[0, c:c + n], padded.loss_mask[b, :n])
        assert torch.equal(packed_adv[0, c:c + n], padded_adv[b, :n])
        assert torch.equal(packed.labels[0, c:c + n - 1], padded.labels[b, :n - 1])
    ones = [torch.ones(len(s) - p) for s, p in zip(seqs, prompts, strict=True)]
    for mb in (padded, packed):  # one value per response token lands exactly on the loss mask
        assert torch.equal(mb.place(ones), mb.loss_mask)
    with pytest.raises(ValueError, match="response tokens"):
        packed.place([torch.ones(len(s) - p + 1) for s, p in zip(seqs, prompts, strict=True)])
    all_rows = list(range(len(seqs)))
    for flag in (False, True):
        mbs = make_micro_batches(seqs, prompts, all_rows, 40, flag)
        back = scatter_rows([mb.place(per_token["adv"]) for mb in mbs], mbs, [len(s) for s in seqs], prompts)
        assert all(torch.equal(b, a) for b, a in zip(back, per_token["adv"], strict=True))


def test_packed_forward_inputs_are_thd_packed_seq_params():
    """What the model (TE's THD attention on GPU, sdpa on CPU) is given for a packed micro-batch."""
    from exgrpo_megatron.policy.batch import forward_inputs

    seqs, prompts = _batch()
    mb = collate(seqs, prompts, [3, 1, 5], packed=True)
    kw = forward_inputs(mb, causal_mask=True)
    params = kw["packed_seq_params"]
    lengths = [len(seqs[i]) for i in (3, 1, 5)]
    assert kw["attention_mask"] is None and kw["input_ids"].shape == (1, sum(lengths))
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q is params.cu_seqlens_kv and params.max_seqlen_q == params.max_seqlen_kv == max(lengths)
    assert kw["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    padded = forward_inputs(collate(seqs, prompts, [3, 1, 5]), causal_mask=True)
    assert "packed_seq_params" not in padded and padded["attention_mask"].shape == (3, 1, max(lengths), max(lengths))


# ----------------------------------------------------------------------------- float64 model reference
def _float64_reference():
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import build_gpt_model
    from exgrpo_megatron.policy.batch import forward_inputs

    cfg = load_config("demo_cpu", ["model=tiny_qwen2"])
    init_distributed(1, 1, seed=cfg.seed)
    model = build_gpt_model(cfg.model, cfg.parallel).double()
    seqs, prompts = _batch()
    rows = list(range(len(seqs)))

    def run(mb):
        model.zero_grad()
        logits = model(**forward_inputs(mb, causal_mask=False)).double()
        (logits.square() * mb.loss_mask[..., None].double()).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return logits.detach(), grads

    def per_row(mb, logits):
        return [logits[r, c:c + n] for (r, c), n in ((mb.row_start(b), n) for b, n in enumerate(mb.lengths))]

    ref_logits, ref_grads = [], None
    for i in rows:  # each sequence alone
        mb = collate(seqs, prompts, [i])
        logits, grads = run(mb)
        ref_logits.append(logits[0])
        ref_grads = grads if ref_grads is None else {k: v + grads[k] for k, v in ref_grads.items()}
    out = {}
    # packed in the planner's order (longest first: the attention splits the packed rows into length groups) and
    # in an arbitrary order (it gathers and scatters them by index)
    longest_first = sorted(rows, key=lambda i: (-len(seqs[i]), i))
    assert longest_first != rows
    for name, packed, order in (("padded", False, rows), ("packed", True, rows),
                                ("packed_longest_first", True, longest_first)):
        mb = collate(seqs, prompts, order, packed=packed)
        logits, grads = run(mb)
        ref = [ref_logits[rows.index(i)] for i in order]
        out[name] = {
            "logits": max(float((a - b).abs().max()) for a, b in zip(per_row(mb, logits), ref, strict=True)),
            "grads": max(float((grads[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                         for k, v in ref_grads.items()),
        }
    return out


def test_padded_and_packed_equal_each_sequence_alone_float64():
    (res,) = run_on_ranks(_float64_reference, world_size=1)
    assert set(res) == {"padded", "packed", "packed_longest_first"}
    for name, errs in res.items():
        assert errs["logits"] < 1e-12, (name, errs)
        assert errs["grads"] < 1e-12, (name, errs)


# ----------------------------------------------------------------------------- production path, fp32
def _ce_loss(normaliser: float):
    def loss_fn(output, mb):  # the production log-prob path (policy/output_layer.py), fused or not
        logp, _ = output.logprobs_entropy(mb, vocab_size=None, with_entropy=False)
        loss = (-logp * mb.loss_mask).sum() / normaliser
        return loss, {"loss_sum": loss.detach()}

    return loss_fn


def _policy_run(tp: int, pp: int, overrides: tuple[str, ...], init: dict | None = None):
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy
    from tests.helpers.gather import load_full_tensors

    cfg = load_config("demo_cpu", ["model=tiny_qwen2", "trainer.total_steps=1", *overrides,
                                   f"parallel.tensor_model_parallel_size={tp}",
                                   f"parallel.pipeline_model_parallel_size={pp}"])
    init_distributed(tp, pp, seed=cfg.seed)
    policy = Policy(cfg)
    if init is not None:
        load_full_tensors(policy.modules, init)
    seqs, prompts = _batch(9, seed=1)
    normaliser = float(sum(len(s) - p for s, p in zip(seqs, prompts, strict=True)))
    mbs = make_micro_batches(seqs, prompts, list(range(len(seqs))), 48, cfg.trainer.sequence_packing)
    policy.zero_grad()
    metrics = policy.forward_backward(mbs, _ce_loss(normaliser), site="test")
    loss = float(torch.stack([m["loss_sum"] for m in metrics]).sum())
    return {"loss": loss, "grads": full_tensors(policy.modules, "grad"),
            "initial": full_tensors(policy.modules, "data"),
            "padding_share": policy.take_padding_share(), "n_micro": len(mbs)}


def _compare(ref: dict, got: dict, tol: float = 2e-5) -> None:
    assert abs(ref["loss"] - got["loss"]) <= tol * abs(ref["loss"]), (ref["loss"], got["loss"])
    assert set(ref["grads"]) == set(got["grads"])
    for k, r in ref["grads"].items():
        err = float((got["grads"][k] - r).abs().max() / r.abs().max().clamp_min(1e-12))
        assert err <= tol, (k, err)


PACKED, PADDED = ("trainer.sequence_packing=true",), ("trainer.sequence_packing=false",)
MEGATRON_ATTN = ("trainer.sequence_packing=false", "model.core_attention=megatron")
UNFUSED = "model.fused_norm_rope=false"


def _single_rank_switches():
    return {name: _policy_run(1, 1, o) for name, o in
            (("packed", PACKED), ("padded", PADDED), ("megatron_attn", MEGATRON_ATTN),
             ("packed_unfused", (*PACKED, UNFUSED)), ("padded_unfused", (*PADDED, UNFUSED)))}


def test_switches_give_same_loss_and_grads():
    (res,) = run_on_ranks(_single_rank_switches, world_size=1)
    assert res["packed"]["padding_share"] == 0.0 and res["padded"]["padding_share"] > 0.1
    assert res["packed"]["n_micro"] <= res["padded"]["n_micro"]
    _compare(res["padded"], res["packed"])  # trainer.sequence_packing
    _compare(res["megatron_attn"], res["padded"])  # model.core_attention: sdpa vs megatron
    _compare(res["packed_unfused"], res["packed"])  # model.fused_norm_rope, packed (THD RoPE)
    _compare(res["padded_unfused"], res["padded"])  # model.fused_norm_rope, padded


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_packed_parallel_invariance(tp, pp):
    (ref,) = run_on_ranks(_policy_run, world_size=1, args=(1, 1, PACKED))
    results = run_on_ranks(_policy_run, world_size=2, args=(tp, pp, PACKED, ref["initial"]))
    for got in results:  # grads gathered and the loss broadcast to every rank
        _compare(ref, got)


# ----------------------------------------------------------------------------- core attention, float64
def _core_attention_cases():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import causal_attention_mask, transformer_config
    from exgrpo_megatron.model.sdpa_attention import SDPADotProductAttention

    cfg = load_config("demo_cpu", ["model=tiny_qwen2"])
    init_distributed(1, 1, seed=cfg.seed)
    tcfg = transformer_config(cfg.model, cfg.parallel)
    kw = dict(config=tcfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ref, sdpa = DotProductAttention(**kw), SDPADotProductAttention(**kw)
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 11, 3, tcfg.num_attention_heads, tcfg.num_query_groups, tcfg.kv_channels
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False  # left padding, as the rollout engine's prefill has
    key_padding = causal_attention_mask(s, b) | ~valid[:, None, None, :]
    decode = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    decode[1, ..., :4] = True
    cases = {"causal mask": (s, causal_attention_mask(s, b)), "left padding": (s, key_padding),
             "decode, one query": (1, decode)}
    errs = {}
    for name, (sq, mask) in cases.items():
        q = torch.randn(sq, b, heads, d, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(s, b, groups, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
        out = {}
        for label, module, m in (("ref", ref, mask), ("sdpa", sdpa, mask), ("sdpa, no mask", sdpa, None)):
            if m is None and sq != s:
                continue
            o = module(q, k, v, m)
            grads = torch.autograd.grad((o * o.detach().cos()).sum(), (q, k, v))
            out[label] = (o.detach(), grads)
        for label in out.keys() - {"ref"}:
            if label == "sdpa, no mask" and name != "causal mask":
                continue
            o, grads = out[label]
            errs[f"{name} / {label}"] = max([float((o - out["ref"][0]).abs().max())]
                                            + [float((a - r).abs().max()) for a, r in zip(grads, out["ref"][1],
                                                                                           strict=True)])
    return errs


def test_sdpa_core_attention_equals_megatron_local_float64():
    (errs,) = run_on_ranks(_core_attention_cases, world_size=1)
    assert len(errs) == 4, errs
    assert max(errs.values()) < 1e-12, errs


@pytest.mark.parametrize("lengths", [[7], [1, 1, 1], [40, 3, 38, 2, 20, 21, 5, 39, 1], list(range(1, 60))])
def test_length_groups_cover_every_sequence_within_the_padding_limit(lengths):
    from exgrpo_megatron.model.sdpa_attention import PACKED_PADDING_LIMIT, length_groups

    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert lengths[g[0]] == longest  # the group's first member sets its padded length
        assert len(g) == 1 or len(g) * longest <= PACKED_PADDING_LIMIT * sum(lengths[i] for i in g)
    if lengths == [40, 3, 38, 2, 20, 21, 5, 39, 1]:  # longest first; the short tail (3, 2, 1) gets its own call
        assert groups == [[0, 7, 2, 5, 4, 6], [1, 3, 8]]


def test_packing_config_errors_name_the_key():
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.config.validate import all_errors, config_errors

    assert not any("sequence_packing" in e for e in config_errors(load_config("demo_cpu"), 1))
    cfg = load_config("demo_cpu", ["model.layer_spec=local", "model.core_attention=megatron",
                                   "trainer.sequence_packing=true"])
    assert any(e.startswith("trainer.sequence_packing:") for e in config_errors(cfg, 1))
    cfg = load_config("demo_cpu", ["model.core_attention=flash"])
    assert any(e.startswith("model.core_attention:") for e in all_errors(cfg, 1, check_paths=False))
    cfg = load_config("demo_cpu", ["model.layer_spec=local", "model.core_attention=megatron",
                                   "trainer.sequence_packing=false"])
    assert not any("sequence_packing" in e or "core_attention" in e for e in config_errors(cfg, 1))
