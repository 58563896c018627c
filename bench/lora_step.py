"""One training update of the real model with LoRA vs full fine-tuning, side by side: SmolLM2-135M-Instruct's shape
(`smollm2_word_problems`, fp32, 2 threads), the policy's own update (forward + backward of the ExGRPO loss over the
preset's micro-batches, then the optimizer step) on a batch of the preset's size: train_batch_size x n sequences of
prompt max_prompt_length / 2 + response max_response_length tokens.

    nice .venv/bin/python bench/lora_step.py [--rounds 2] [--steps 2] [--rank 32 --alpha 32]

Each arm runs in a fresh process (one gloo rank, random weights: the time and memory depend on the shape only), the
arms interleaved (round r in order, round r+1 in reverse) so load on the shared machine hits both alike; per arm one
warm-up update, then `--steps` timed ones. Reported per arm: the median update time, tokens/s, the model FLOP/s and
their fraction of this machine's fp32 GEMM peak measured in the same run (bench/machine_peaks.py, before and after
the arms: the larger), the process's peak RSS (ru_maxrss) and its growth from before the model was built, and the
trainable state megatron allocated: parameters, DDP gradient buffers and Adam state (exact, from the tensors).
FLOPs per token: full fine-tuning 6 N (forward 2 N, backward 4 N: input and weight gradients) with N the matmul
weights (QKV, o_proj, fc1, fc2, the output layer) plus attention's 12 L s d_attn; with LoRA the base's weight
gradients are not computed: 4 N plus 6 N_adapters. Writes bench/results/lora_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from machine_peaks import measure_peaks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "lora_step.json")
PRESET = "smollm2_word_problems"
THREADS = 2


def arm_overrides(arm: str, rank: int, alpha: float) -> list[str]:
    return ["model.params_dtype=fp32", *([f"lora.rank={rank}", f"lora.alpha={alpha}"] if arm == "lora" else [])]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def worker(overrides: list[str], steps: int, out: str) -> None:
    """Build the policy, run 1 + `steps` updates, write the times and the allocation to `out`."""
    import torch

    from exgrpo_megatron.algo.loss import global_loss_counts
    from exgrpo_megatron.algo.registry import build_algorithm
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.distributed.runtime import init_distributed
    from exgrpo_megatron.experience.schedule import Phase
    from exgrpo_megatron.policy.objective import rl_loss_fn
    from exgrpo_megatron.policy.policy import Policy
    from exgrpo_megatron.policy.train_batch import RolloutRows, TrainBatch, micro_batches_for_update

    torch.set_num_threads(THREADS)
    cfg = load_config(PRESET, overrides)
    init_distributed(seed=cfg.seed)
    rss_before = _rss_mib()
    policy = Policy(cfg)
    g = torch.Generator().manual_seed(0)
    n, prompt, response = cfg.trainer.train_batch_size * cfg.rollout.n, cfg.data.max_prompt_length // 2, \
        cfg.data.max_response_length
    seqs = [torch.randint(0, cfg.model.vocab_size, (prompt + response,), generator=g).tolist() for _ in range(n)]
    rows = RolloutRows(seqs, [prompt] * n, [-(torch.rand(response, generator=g) + 0.5) for _ in range(n)],
                       rewards=[float(i % 2) for i in range(n)], advantages=[0.5 - (i % 2) for i in range(n)],
                       is_replay=[False] * n, group_index=[i // cfg.rollout.n for i in range(n)])
    batch = TrainBatch.of(rows, old_logprobs=None)
    index = list(range(n))
    algorithm = build_algorithm(cfg.algo, cfg.trainer, cfg.data.max_response_length)
    from megatron.core import parallel_state as ps

    counts = global_loss_counts([batch.response_lengths[i] for i in index], ps.get_data_parallel_group())
    loss_fn = rl_loss_fn(algorithm, phase=Phase.MIXED, normalisers=algorithm.normalisers(*counts), temperature=1.0)
    micro = micro_batches_for_update(batch, index, max_tokens=cfg.trainer.micro_batch_max_tokens, packed=True)
    times = []
    for _ in range(1 + steps):
        start = time.perf_counter()
        policy.zero_grad()
        policy.forward_backward(micro, loss_fn, site="update")
        policy.optimizer_step(skip_grad_bound=1e9)
        times.append(time.perf_counter() - start)
    params = [q for module in policy.modules for q in module.parameters()]
    adam = sum(t.numel() * t.element_size() for opt in getattr(policy.optimizer, "chained_optimizers",
                                                                [policy.optimizer])
               for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t))
    result = {"overrides": overrides, "update_s": times[1:], "warmup_s": times[0], "tokens": n * (prompt + response),
              "micro_batches": len(micro), "parameters": sum(q.numel() for q in params),
              "trainable": sum(q.numel() for q in params if q.requires_grad),
              "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size()
                                       for c in policy.chunks for b in [*c.buffers, *c.expert_parallel_buffers]),
              "param_bytes": sum(q.numel() * q.element_size() for q in params), "adam_bytes": adam,
              "rss_before_model_mib": rss_before,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(out, "w") as f:
        json.dump(result, f)


def model_flops_per_token(overrides: list[str], trainable: int) -> float:
    from exgrpo_megatron.config.derived import head_dim
    from exgrpo_megatron.config.loader import load_config
    from exgrpo_megatron.planning.model_size import count_parameters

    cfg = load_config(PRESET, overrides)
    m, c = cfg.model, count_parameters(cfg.model)
    matmul = m.num_layers * c.per_layer_sharded + (c.output_layer or c.embedding)
    seq = cfg.data.max_prompt_length // 2 + cfg.data.max_response_length
    attention = 12 * m.num_layers * seq * m.num_attention_heads * head_dim(m)
    if cfg.lora.rank > 0:
        return 4 * matmul + 6 * trainable + attention
    return 6 * matmul + attention


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    from exgrpo_megatron.distributed.launch_env import free_local_port

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   MASTER_PORT=str(free_local_port()), PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
                       "PYTHONPATH")])))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
            env.pop(var, None)
        subprocess.run([sys.executable, __file__, "--worker", arm, "--steps", str(args.steps), "--rank",
                        str(args.rank), "--alpha", str(args.alpha), "--out", out.name], cwd=REPO, env=env, check=True)
        with open(out.name) as f:
            return json.load(f)


def summarise(arm: str, records: list[dict], args: argparse.Namespace, fp32_peak: float) -> dict:
    first = records[0]
    update_s = statistics.median(t for r in records for t in r["update_s"])
    flops = model_flops_per_token(arm_overrides(arm, args.rank, args.alpha), first["trainable"]) * first["tokens"]
    return {"arm": arm, "parameters": first["parameters"], "trainable": first["trainable"],
            "median_update_s": update_s, "min_update_s": min(t for r in records for t in r["update_s"]),
            "tokens_per_s": first["tokens"] / update_s, "model_gflops_per_update": flops / 1e9,
            "achieved_gflops": flops / update_s / 1e9, "fraction_of_fp32_peak": flops / update_s / 1e9 / fp32_peak,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in records),
            "rss_growth_mib": max(r["peak_rss_mib"] - r["rss_before_model_mib"] for r in records),
            **{k: first[k] for k in ("param_bytes", "grad_buffer_bytes", "adam_bytes", "tokens", "micro_batches")}}


def table(rows: list[dict]) -> str:
    mib = 1 << 20
    lines = ["| arm | trainable | update s (median) | tokens/s | GFLOP/s (of fp32 peak) | peak RSS MiB (growth) | "
             "params / grads / Adam MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['trainable']:,} | {r['median_update_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['achieved_gflops']:.1f} ({r['fraction_of_fp32_peak']:.0%}) | {r['peak_rss_mib']:.0f} "
                     f"({r['rss_growth_mib']:.0f}) | {r['param_bytes'] / mib:.0f} / {r['grad_buffer_bytes'] / mib:.0f}"
                     f" / {r['adam_bytes'] / mib:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed updates per arm and round (after 1 warm-up)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--worker", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(arm_overrides(args.worker, args.rank, args.alpha), args.steps, args.out)
    peaks_before = measure_peaks(THREADS)
    records: dict[str, list[dict]] = {"full": [], "lora": []}
    for r in range(args.rounds):
        for arm in (["full", "lora"] if r % 2 == 0 else ["lora", "full"]):
            records[arm].append(run_arm(arm, args))
            print(f"[lora_step] round {r + 1} {arm}: {records[arm][-1]['update_s']}", file=sys.stderr, flush=True)
    peaks_after = measure_peaks(THREADS)
    fp32_peak = max(peaks_before["fp32_peak_gflops"], peaks_after["fp32_peak_gflops"])
    rows = [summarise(arm, records[arm], args, fp32_peak) for arm in ("full", "lora")]
    full, lora = rows
    ratios = {"update_time_lora_over_full": lora["median_update_s"] / full["median_update_s"],
              "rss_growth_lora_over_full": lora["rss_growth_mib"] / full["rss_growth_mib"],
              "trainable_state_bytes_lora_over_full": (lora["grad_buffer_bytes"] + lora["adam_bytes"])
              / (full["grad_buffer_bytes"] + full["adam_bytes"])}
    results = {"command": " ".join([sys.executable, *sys.argv]), "preset": PRESET, "threads": THREADS,
               "lora": {"rank": args.rank, "alpha": args.alpha}, "machine_peaks": {"before": peaks_before,
                                                                                   "after": peaks_after},
               "fp32_peak_gflops": fp32_peak, "arms": rows, "ratios": ratios, "records": records,
               "load_average": os.getloadavg()}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)
    print(table(rows))
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
