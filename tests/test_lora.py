"""LoRA adapters (model/lora.py): the adapted linears against a float64 reference at TP=1 and TP=2; a tiny policy
with adapters at TP=2, PP=2 and DP=2 (unequal data per rank) against TP=1 in fp32, its base weights frozen (no
gradient buffer, no optimizer state, bitwise unchanged by a step); checkpoints across layouts; start-up refusals."""

from __future__ import annotations

import pytest
import torch

from exgrpo_megatron.config.loader import load_config
from exgrpo_megatron.config.schema import LoraConfig, RootConfig
from exgrpo_megatron.config.validate import all_errors
from exgrpo_megatron.model.param_layout import TPSplit, is_adapter, tp_shard, tp_split_of_param
from tests.helpers.gather import full_tensors, load_full_tensors, with_random_lora_b
from tests.helpers.multirank import run_on_ranks
from tests.test_parallel_invariance import _batch, _ce_loss

RANK, ALPHA = 4, 16.0  # scale alpha / r = 4: a scale applied twice (16) or left out (1) is visible
LORA = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}"]
IN, OUT = 24, 16


def _linear_cases(tp: int) -> list[dict]:
    """Column (stride 1 and SwiGLU's stride 2) and row-parallel adapted linears on this TP rank, with every weight
    drawn in full and sharded as the module records; returns per case: max relative errors against float64."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import transformer_config
    from exgrpo_megatron.model.lora import LoraColumnParallelLinear, LoraRowParallelLinear

    cfg = load_config("demo_cpu", ["model=tiny_qwen2", "model.params_dtype=fp32",
                                   f"parallel.tensor_model_parallel_size={tp}"])
    init_distributed(tp, 1, seed=cfg.seed)
    tcfg = transformer_config(cfg.model, cfg.parallel)
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    rank = ps.get_tensor_model_parallel_rank()
    out = []
    for kind in ("column", "swiglu", "row"):
        zeros = torch.nn.init.zeros_
        if kind == "row":
            module: torch.nn.Module = LoraRowParallelLinear(IN, OUT, config=tcfg, init_method=zeros, bias=False,
                                                            input_is_parallel=True, skip_bias_add=True, lora=lora)
        else:
            module = LoraColumnParallelLinear(IN, OUT, config=tcfg, init_method=zeros, bias=False,
                                              gather_output=False, stride=2 if kind == "swiglu" else 1, lora=lora)
        g = torch.Generator().manual_seed(11)
        full = {"weight": torch.randn(OUT, IN, generator=g), "lora_a": torch.randn(RANK, IN, generator=g),
                "lora_b": torch.randn(OUT, RANK, generator=g)}
        x, gy = torch.randn(5, 3, IN, generator=g), torch.randn(5, 3, OUT, generator=g)
        params = {name: getattr(module, name) for name in full}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tp_shard(full[name], tp_split_of_param(p), tp, rank))
        # float64 reference, independent of the module: y = x W^T + x A^T B^T alpha / r
        ref = {k: v.double().requires_grad_() for k, v in {**full, "x": x}.items()}
        y_ref = ref["x"] @ ref["weight"].T + (ref["x"] @ ref["lora_a"].T @ ref["lora_b"].T) * (ALPHA / RANK)
        (y_ref * gy.double()).sum().backward()

        w_split = tp_split_of_param(module.weight)
        assert w_split is not None or tp == 1
        out_split = TPSplit(2, w_split.stride) if kind != "row" and w_split else None  # column: y split as W's rows
        in_split = TPSplit(2) if kind == "row" else None  # row: x split as W's columns
        x_local = tp_shard(x, in_split, tp, rank).clone().requires_grad_()
        y, _ = module(x_local)
        (y * tp_shard(gy, out_split, tp, rank)).sum().backward()

        def rel(got: torch.Tensor, want: torch.Tensor) -> float:
            return float((got.double() - want).abs().max() / want.abs().max())

        errors = {"y": rel(y, tp_shard(y_ref.detach(), out_split, tp, rank)),
                  "dx": rel(x_local.grad, tp_shard(ref["x"].grad, in_split, tp, rank))}
        for name, p in params.items():
            errors[f"d{name}"] = rel(p.grad, tp_shard(ref[name].grad, tp_split_of_param(p), tp, rank))
        out.append({"kind": kind, "errors": errors,
                    "a_split": tp_split_of_param(module.lora_a), "b_split": tp_split_of_param(module.lora_b)})
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_adapted_linears_match_a_float64_reference(tp):
    for per_rank in run_on_ranks(_linear_cases, tp, args=(tp,)):
        for case in per_rank:
            for what, err in case["errors"].items():
                assert err < 1e-5, (tp, case["kind"], what, err)
    if tp == 2:  # the factor on the sharded side of the base is the sharded one
        cases = {c["kind"]: c for c in per_rank}
        assert cases["column"]["a_split"] is None and cases["column"]["b_split"] == TPSplit(0, 1)
        assert cases["swiglu"]["b_split"] == TPSplit(0, 2)
        assert cases["row"]["a_split"] == TPSplit(1, 1) and cases["row"]["b_split"] is None


def _policy_step(tp: int, init: dict | None, distributed_optimizer: bool = False, pp: int = 1,
                 extra: tuple[str, ...] = ("model=tiny_qwen2",)) -> dict:
    """One forward/backward + optimizer step of the tiny policy with adapters; B is drawn non-zero (at init it is
    0, which would hide a wrongly sharded B and A's gradient) on the TP=1 run and loaded by the others."""
    from megatron.core import parallel_state as ps

    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.batch import collate, plan_micro_batches
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", [*extra, "model.params_dtype=fp32", "optim.lr=0.01",
                                   "optim.adam_eps=1e-3", "trainer.total_steps=1", *LORA,
                                   f"parallel.tensor_model_parallel_size={tp}",
                                   f"parallel.pipeline_model_parallel_size={pp}",
                                   f"parallel.use_distributed_optimizer={str(distributed_optimizer).lower()}"])
    init_distributed(tp, pp, seed=cfg.seed, expert_model_parallel_size=cfg.parallel.expert_model_parallel_size)
    policy = Policy(cfg)
    if init is None:
        init = with_random_lora_b(full_tensors(policy.modules, "data"), seed=3)
    load_full_tensors(policy.modules, init)
    frozen = [p for m in policy.modules for n, p in m.named_parameters() if not is_adapter(n)]
    adapters = [p for m in policy.modules for n, p in m.named_parameters() if is_adapter(n)]
    seqs, prompts = _batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [i for i in range(len(seqs)) if i % dp == dp_rank]  # DP=2: rows of other lengths per rank
    normaliser = float(sum(len(s) - p for s, p in zip(seqs, prompts, strict=True)))
    plan = plan_micro_batches([len(seqs[i]) for i in mine], 32)
    policy.zero_grad()
    metrics = policy.forward_backward([collate(seqs, prompts, [mine[j] for j in rows]) for rows in plan],
                                      _ce_loss(normaliser), site="update")
    loss = torch.stack([m["loss_sum"] for m in metrics]).sum()
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    grads = full_tensors(policy.modules, "grad", trainable_only=True)
    result = policy.optimizer_step(skip_grad_bound=1e9)
    inner = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    if distributed_optimizer:  # it steps fp32 shards of the adapters' buffer, not the parameters themselves
        buffers = [b for c in policy.chunks for b in c.buffers]
        optimized = with_state = {id(p) for b in buffers for p in b.params}
    else:
        optimized = {id(p) for o in inner for group in o.optimizer.param_groups for p in group["params"]}
        with_state = {id(p) for o in inner for p in o.optimizer.state}
    return {"init": init, "loss": float(loss), "grads": grads, "weights": full_tensors(policy.modules, "data"),
            "grad_norm": result.grad_norm, "rows": len(mine),
            "frozen_have_grad_buffer": any(hasattr(p, "main_grad") or p.requires_grad for p in frozen),
            "optimizer_params_are_adapters": optimized == {id(p) for p in adapters} == with_state}


def test_tp2_dp2_and_pp2_with_adapters_equal_tp1_and_only_adapters_train():
    ref = run_on_ranks(_policy_step, 1, args=(1, None))[0]
    assert not ref["frozen_have_grad_buffer"] and ref["optimizer_params_are_adapters"]
    assert ref["grads"] and all(is_adapter(k) for k in ref["grads"])
    for name, w in ref["weights"].items():  # the step moved every adapter and no base weight, bit for bit
        assert torch.equal(w, ref["init"][name]) != is_adapter(name), name
    # TP=2; DP=2; DP=2 with the distributed optimizer (each rank steps half of the adapters); PP=2
    for tp, distributed_optimizer, pp in ((2, False, 1), (1, False, 1), (1, True, 1), (1, False, 2)):
        for got in run_on_ranks(_policy_step, 2, args=(tp, ref["init"], distributed_optimizer, pp)):
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (tp, got["loss"], ref["loss"])
            assert set(got["grads"]) == set(ref["grads"])
            for k, rg in ref["grads"].items():
                if distributed_optimizer:  # reduce-scattered: each rank's buffer holds the sum of its shard only
                    break
                err = (got["grads"][k] - rg).abs().max() / rg.abs().max().clamp_min(1e-12)
                assert err <= 1e-5, (tp, k, float(err))
            for k, rw in ref["weights"].items():
                assert torch.allclose(got["weights"][k], rw, rtol=0, atol=1e-6), (tp, k)
            assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"]
            assert not got["frozen_have_grad_buffer"] and got["optimizer_params_are_adapters"]
    assert ref["rows"] == 4


def test_ep2_with_adapters_on_the_experts_equals_ep1():
    moe = ("model=tiny_qwen3_moe", "lora.experts=true")
    ref = run_on_ranks(_policy_step, 1, kwargs={"tp": 1, "init": None, "extra": moe})[0]
    assert any(".experts." in k for k in ref["grads"]) and not ref["frozen_have_grad_buffer"]
    for got in run_on_ranks(_policy_step, 2, kwargs={"tp": 1, "init": ref["init"],
                                                     "extra": (*moe, "parallel.expert_model_parallel_size=2")}):
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        for k, rg in ref["grads"].items():
            err = (got["grads"][k] - rg).abs().max() / rg.abs().max().clamp_min(1e-12)
            assert err <= 1e-5, (k, float(err))
        for k, rw in ref["weights"].items():
            assert torch.allclose(got["weights"][k], rw, rtol=0, atol=1e-6), k
        assert not got["frozen_have_grad_buffer"] and got["optimizer_params_are_adapters"]


@pytest.mark.parametrize("override, key", [
    (["lora.rank=-1"], "lora.rank"), (["lora.alpha=0"], "lora.alpha"), (["lora.dropout=1.0"], "lora.dropout"),
    (["lora.init=xavier"], "lora.init"), (["lora.targets=[linear_qkv,router]"], "lora.targets"),
    (["lora.targets=[]", "lora.rank=8"], "lora.targets"),
    (["lora.init_from=/an/adapter"], "lora.init_from"),  # adapters to start from, in a run without adapters
    (["lora.rank=8", "model.layer_spec=te"], "model.layer_spec"),
    (["lora.rank=8", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel"),
])
def test_invalid_lora_settings_name_the_key(override, key):
    errors = all_errors(load_config("demo_cpu", override), world_size=2, check_paths=False)
    assert any(e.startswith(f"{key}:") for e in errors), errors
    assert not all_errors(load_config("demo_cpu", LORA), world_size=1, check_paths=False)


@pytest.mark.parametrize("layer_spec, te_available, rank, refused", [
    ("auto", True, RANK, True),  # a GPU with Transformer Engine: auto builds TE's linears, which have no adapters
    ("auto", False, RANK, False), ("local", True, RANK, False), ("te", False, RANK, True), ("auto", True, 0, False),
])
def test_a_layer_spec_resolving_to_te_is_refused_with_adapters(layer_spec, te_available, rank, refused):
    from exgrpo_megatron.config.derived import resolve_layer_spec
    from exgrpo_megatron.config.validate import lora_errors

    cfg = load_config("demo_cpu", [f"lora.rank={rank}", f"model.layer_spec={layer_spec}"])
    assert resolve_layer_spec(cfg.model, te_available) == ("te" if layer_spec == "te" or (
        layer_spec == "auto" and te_available) else "local")  # the builder's resolver, given the machine
    errors = [e for e in lora_errors(cfg, te_available) if e.startswith("model.layer_spec:")]
    assert bool(errors) == refused, errors


def _weights_round_trip(overrides: list[str], save_to: str | None, load_from: str | None) -> dict:
    """Save this layout's policy (B drawn non-zero) as weights-only, or load one saved at another layout."""
    from exgrpo_megatron.checkpoint import model_config_to_yaml
    from exgrpo_megatron.checkpoint.weights import save_model_weights
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy

    cfg = load_config("demo_cpu", ["model.params_dtype=fp32", "trainer.total_steps=1", *LORA, *overrides])
    p = cfg.parallel
    init_distributed(p.tensor_model_parallel_size, 1, seed=cfg.seed,
                     expert_model_parallel_size=p.expert_model_parallel_size)
    policy = Policy(cfg)
    if save_to is not None:
        full = with_random_lora_b(full_tensors(policy.modules, "data"), seed=5, scale=1.0)
        load_full_tensors(policy.modules, full)
        save_model_weights(save_to, policy.modules, model_config_yaml=model_config_to_yaml(cfg.model))
    if load_from is not None:
        policy.load_weights(load_from)
    return full_tensors(policy.modules, "data")


@pytest.mark.parametrize("model, layout, experts", [
    ("tiny_qwen2", "parallel.tensor_model_parallel_size=2", False),  # B / A split over TP, fc1's stride 2
    ("tiny_qwen3_moe", "parallel.expert_model_parallel_size=2", True),  # the experts' adapters over EP
])
def test_adapters_saved_at_two_ranks_load_at_one(tmp_path, model, layout, experts):
    overrides = [f"model={model}", f"lora.experts={str(experts).lower()}"]
    saved = run_on_ranks(_weights_round_trip, 2, args=([*overrides, layout], str(tmp_path / "w"), None))[0]
    loaded = run_on_ranks(_weights_round_trip, 1, args=(overrides, None, str(tmp_path / "w")))[0]
    assert set(saved) == set(loaded)
    assert any(".experts." in n and is_adapter(n) for n in saved) == experts
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_vllm_with_lora_is_a_valid_config():
    """The vLLM refit streams the merged weights (rollout/refit.py; tested in tests/vllm/test_lora_refit.py)."""
    cfg = load_config("demo_cpu", [*LORA, "rollout.engine=vllm", "model.hf_path=/x"])
    assert not [e for e in all_errors(cfg, world_size=1, check_paths=False) if "lora" in e], cfg.rollout.engine


def test_startup_block_names_the_adapters_only_when_on():
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.distributed.runtime import ParallelLayout
    from exgrpo_megatron.logging.startup import startup_block

    def block(cfg: RootConfig) -> str:
        return startup_block(cfg, layout, build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length))

    layout = ParallelLayout(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1,
                            device=torch.device("cpu"))
    on = block(load_config("demo_cpu", [*LORA, "lora.targets=[linear_qkv]"])).splitlines()
    assert on[-1] == ("exgrpo-train: LoRA rank 4, alpha 16 on linear_qkv: the base weights are frozen, only the "
                      "adapters train")
    assert "LoRA" not in block(load_config("demo_cpu", []))


def _dropout_cases(p: float) -> dict:
    """An adapted column-parallel linear with `lora.dropout` p at TP=1: its output in training mode and in eval mode,
    and a float64 reference of each (the training mask drawn again from the same torch seed)."""
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.model.builder import transformer_config
    from exgrpo_megatron.model.lora import LoraColumnParallelLinear

    cfg = load_config("demo_cpu", ["model=tiny_qwen2", "model.params_dtype=fp32"])
    init_distributed(1, 1, seed=cfg.seed)
    module = LoraColumnParallelLinear(IN, OUT, config=transformer_config(cfg.model, cfg.parallel),
                                      init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
                                      lora=LoraConfig(rank=RANK, alpha=ALPHA, dropout=p))
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name in ("weight", "lora_a", "lora_b"):
            getattr(module, name).copy_(torch.randn(getattr(module, name).shape, generator=g))
    x = torch.randn(5, 3, IN, generator=g)
    w, a, b = (getattr(module, n).detach().double() for n in ("weight", "lora_a", "lora_b"))

    def reference(mask: torch.Tensor) -> torch.Tensor:
        xd = x.double()
        return xd @ w.T + ((xd * mask.double()) @ a.T @ b.T) * (ALPHA / RANK)

    torch.manual_seed(21)
    trained = module.train()(x)[0].detach()
    torch.manual_seed(21)
    mask = torch.nn.functional.dropout(torch.ones_like(x), p, training=True)  # the same draw: keep / (1 - p)
    evaluated = module.eval()(x)[0].detach()
    return {"train": (trained, reference(mask)), "eval": (evaluated, reference(torch.ones_like(x))),
            "dropped": float((mask == 0).float().mean())}


def test_lora_dropout_applies_in_training_mode_only_against_a_float64_reference():
    out = run_on_ranks(_dropout_cases, 1, args=(0.5,))[0]
    assert 0.3 < out["dropped"] < 0.7
    for mode in ("train", "eval"):
        got, want = out[mode]
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6, mode
    assert (out["train"][0] - out["eval"][0]).abs().max() > 0.1  # the mask mattered


def _scored_logprobs(dropout: float) -> dict:
    """The tiny policy with non-zero adapters: token_stats (pi_old, replay scores: the scoring passes) twice after the
    policy was put in training mode, and one training-mode forward of the same rows."""
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import token_stats

    cfg = load_config("demo_cpu", ["model=tiny_qwen2", "model.params_dtype=fp32", "trainer.total_steps=1", *LORA,
                                   f"lora.dropout={dropout}"])
    init_distributed(1, 1, seed=cfg.seed)
    policy = Policy(cfg)
    full = with_random_lora_b(full_tensors(policy.modules, "data"), seed=3)
    load_full_tensors(policy.modules, full)
    seqs, prompts = _batch()
    torch.manual_seed(8)
    scored = []
    for _ in range(2):
        policy.train()  # as the policy is left after an update
        scored.append(torch.cat(token_stats(policy, seqs, prompts, site="old_logprobs", temperature=1.0,
                                            with_entropy=False, max_tokens=64).logprobs))
    policy.train()
    trained = torch.cat([m.detach().flatten() for m in policy.modules[0](*_inputs(seqs[0]))])
    return {"scored": scored, "trained": trained}


def _inputs(seq: list[int]) -> tuple[torch.Tensor, torch.Tensor, None]:
    tokens = torch.tensor([seq])
    return tokens, torch.arange(len(seq)).unsqueeze(0), None


def test_scoring_passes_run_without_lora_dropout_and_updates_with_it():
    plain = run_on_ranks(_scored_logprobs, 1, args=(0.0,))[0]
    dropped = run_on_ranks(_scored_logprobs, 1, args=(0.5,))[0]
    for scored in dropped["scored"]:  # pi_old / replay scores: the function the engine samples from, every time
        assert torch.equal(scored, plain["scored"][0])
    assert not torch.equal(dropped["trained"], plain["trained"])  # the update's forward drops adapter inputs
