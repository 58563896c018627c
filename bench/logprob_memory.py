"""Peak memory and time of the output layer + log-prob + entropy (forward + backward), from the final hidden
states h [N, H] and the output weight W [V, H], three ways:

- naive: logits = h W^T, then log_softmax over the full vocabulary, gather, entropy from the same tensor (fp32);
- unfused: logits = h W^T materialised, then the chunked kernel (`policy/logprobs.py`), trainer path with
  `trainer.fused_output_logprobs=false`;
- fused_chunkC: the output layer fused into the chunked kernel, C rows at a time (`policy/fused_logprobs.py`), the
  trainer's default path; no [N, V] logits or gradient exist.

    python bench/logprob_memory.py                          # spec size: 4 x 1024 tokens, vocab 151,936, H 896
    python bench/logprob_memory.py --seq 256 --chunk-size 128 256

Method (CPU, no torch allocator statistics exist for CPU tensors): each variant runs in a fresh Python
subprocess. After the inputs (h and W with requires_grad, targets, loss weights) are allocated and the RSS has
settled, the process resets the kernel's peak-RSS counter (writes "5" to /proc/self/clear_refs), runs
forward + backward once, and reads VmHWM from /proc/self/status. "peak extra" = VmHWM - RSS before the run:
the memory the method needs on top of its inputs (h, W), including the gradients of h and W (needed by all).
The kernel counter is exact for resident pages (no sampling); freed large buffers are returned to the OS by glibc
(mmap), so reuse between buffers is counted as it happens.
A tiny warm-up run precedes the measurement so one-off library initialisation is not counted.
Time: "first s" is the measured run, "best s" the best of it and `--repeats` further runs in the same process.
Log-probs, entropies and the gradients of h and W are compared with the naive path's (all tokens); log-probs and
entropies also with a float64 reference on `--reference-rows` evenly spaced tokens, and the gradients with a
float64 autograd reference over all tokens (`float64_gradients`): the naive fp32 path is itself an approximation, so
"equal to naive" is judged by each path's distance from float64.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exgrpo_megatron.policy.fused_logprobs import fused_output_logprobs_entropy  # noqa: E402
from exgrpo_megatron.policy.logprobs import vocab_parallel_logprobs_entropy  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "logprob_memory.json"


def naive_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Full-vocabulary float32 reference path: materialises [N, V] log-softmax and its probabilities."""
    log_p = torch.log_softmax(logits.float() / temperature if temperature != 1.0 else logits.float(), dim=-1)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return logp, entropy


def logits_then_chunked(logits, targets, temperature):
    return vocab_parallel_logprobs_entropy(logits, targets, temperature=temperature)


def fused(hidden, weight, targets, temperature, chunk_size):
    return fused_output_logprobs_entropy(hidden, weight, targets, weight.shape[0], chunk_size=chunk_size,
                                         temperature=temperature)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _inputs(args):
    """h [N, H] with unit-variance rows and W [V, H] scaled so the logits have std ~2 (a peaked softmax)."""
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.seq
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(n, args.hidden, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * (2.0 / args.hidden**0.5)).to(dtype)
    weight.requires_grad_(True)
    targets = torch.randint(0, args.vocab, (n,), generator=g)
    w_logp = torch.randn(n, generator=g)
    w_ent = torch.randn(n, generator=g)
    return hidden, weight, targets, w_logp, w_ent


def _step(variant, hidden, weight, targets, w_logp, w_ent, args):
    hidden.grad = weight.grad = None
    if variant == "fused":
        logp, ent = fused(hidden, weight, targets, args.temperature, args.chunk_size)
    else:
        logits = hidden @ weight.t()
        if variant == "naive":
            logp, ent = naive_logprobs_entropy(logits, targets, args.temperature)
        else:
            logp, ent = logits_then_chunked(logits, targets, args.temperature)
        del logits
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    return logp.detach(), ent.detach()


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    hidden, weight, targets, w_logp, w_ent = _inputs(args)
    # One tiny warm-up run so one-off costs (lazy library init, first-touch of code pages) are not counted.
    tiny_h = hidden.detach()[:4].clone().requires_grad_(True)
    tiny_w = weight.detach()[:64].clone().requires_grad_(True)
    _step(args.worker, tiny_h, tiny_w, targets[:4] % 64, w_logp[:4], w_ent[:4], args)
    del tiny_h, tiny_w
    time.sleep(0.2)
    baseline_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    logp, ent = _step(args.worker, hidden, weight, targets, w_logp, w_ent, args)
    first_s = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    grads = {"grad_hidden": hidden.grad.float(), "grad_weight": weight.grad.float()}
    torch.save({"logp": logp, "entropy": ent, **grads}, args.out)
    del grads
    times = [first_s]
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _step(args.worker, hidden, weight, targets, w_logp, w_ent, args)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"baseline_rss_mb": baseline_kb / 1024, "peak_extra_mb": (peak_kb - baseline_kb) / 1024,
                      "first_run_s": first_s, "best_s": min(times)}))


def run_variant(variant: str, chunk_size: int, args, out_path: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--out", out_path, "--chunk-size", str(chunk_size)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab), "--dtype", args.dtype,
            "--hidden", str(args.hidden),
            "--temperature", str(args.temperature), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def float64_reference(args, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-ish log-probs and entropy of the given token rows of the benchmark inputs, in float64."""
    hidden, weight, targets, _, _ = _inputs(args)
    z = (hidden.detach()[rows].double() @ weight.detach().double().t()) / args.temperature
    log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return log_p.gather(-1, targets[rows, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def float64_gradients(args, rows_per_chunk: int = 256) -> dict[str, torch.Tensor]:
    """dL/dh and dL/dW of L = sum(w_logp * logp) + sum(w_ent * entropy) over ALL tokens, in float64.

    Plain autograd of the textbook formulas (log_softmax of h W^T / T), no chunked kernel involved: token rows are
    independent, so the loss is summed chunk by chunk of rows and each chunk's backward accumulates into W's grad
    (peak ~ 3 x [rows_per_chunk, V] float64 + W and its gradient in float64)."""
    hidden, weight, targets, w_logp, w_ent = _inputs(args)
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    for start in range(0, h64.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        log_p = torch.log_softmax(h64[rows] @ w64.t() / args.temperature, dim=-1)
        logp = log_p.gather(-1, targets[rows, None]).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        ((w_logp[rows].double() * logp).sum() + (w_ent[rows].double() * entropy).sum()).backward()
    return {"grad_hidden": h64.grad, "grad_weight": w64.grad}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk-size", type=int, nargs="+", default=[128, 256], help="one fused run per chunk size")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=["naive", "unfused", "fused"],
                   choices=["naive", "unfused", "fused"],
                   help="naive always runs (the baseline); fused once per --chunk-size")
    p.add_argument("--reference-rows", type=int, default=256, help="token rows checked against float64 (evenly spaced)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", choices=["naive", "unfused", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. why sizes were reduced)")
    args = p.parse_args()
    if args.worker:
        args.chunk_size = args.chunk_size[0]
        worker(args)
        return

    variants = [("naive", 0)] + [("unfused", 0)] * ("unfused" in args.variants)
    variants += [(f"fused_chunk{c}", c) for c in args.chunk_size] if "fused" in args.variants else []
    results, diffs = {}, {}
    ref_rows = torch.linspace(0, args.batch * args.seq - 1, min(args.reference_rows, args.batch * args.seq)).long()
    ref_logp, ref_ent = float64_reference(args, ref_rows)
    ref_grads = float64_gradients(args)
    grad_scale = {k: g.abs().max().item() for k, g in ref_grads.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, chunk in variants:
            path = os.path.join(tmp, f"{name}.pt")
            results[name] = run_variant(name.split("_")[0], chunk, args, path)
            out = torch.load(path)
            if name == "naive":
                naive = out
            diffs[name] = {
                "logp_vs_float64": (out["logp"][ref_rows].double() - ref_logp).abs().max().item(),
                "entropy_vs_float64": (out["entropy"][ref_rows].double() - ref_ent).abs().max().item(),
                "entropy_rel_vs_float64": ((out["entropy"][ref_rows].double() - ref_ent).abs() / ref_ent.abs()).max()
                .item(),
                "logp_vs_naive": (out["logp"] - naive["logp"]).abs().max().item(),
                "entropy_vs_naive": (out["entropy"] - naive["entropy"]).abs().max().item(),
                "grad_hidden_vs_naive": (out["grad_hidden"] - naive["grad_hidden"]).abs().max().item(),
                "grad_weight_vs_naive": (out["grad_weight"] - naive["grad_weight"]).abs().max().item(),
                **{f"{k}_vs_float64": (out[k].double() - ref_grads[k]).abs().max().item() for k in ref_grads},
                "time_over_naive": results[name]["best_s"] / results["naive"]["best_s"],
            }
            del out
        del naive

    elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    logits_mb = args.batch * args.seq * args.vocab * elem / 2**20
    naive_peak = results["naive"]["peak_extra_mb"]
    print(f"tokens={args.batch}x{args.seq} vocab={args.vocab} dtype={args.dtype} threads={args.threads}; "
          f"logits tensor = {logits_mb:.0f} MiB; peak extra = VmHWM - RSS before forward+backward")
    header = (f"{'variant':<16} {'peak extra MiB':>14} {'x logits':>8} {'/naive':>7} {'first s':>8} {'best s':>7} "
              f"{'/naive t':>8} {'|dlogp|':>9} {'|dH|':>9} {'rel dH':>9} {'|dg_h|':>9} {'|dg_W|':>9} {'|g_h-64|':>9} "
              f"{'|g_W-64|':>9}")
    print(header)
    for name, r in results.items():
        d = diffs[name]
        print(f"{name:<16} {r['peak_extra_mb']:>14.0f} {r['peak_extra_mb'] / logits_mb:>8.2f} "
              f"{r['peak_extra_mb'] / naive_peak:>7.3f} {r['first_run_s']:>8.2f} {r['best_s']:>7.2f} "
              f"{d['time_over_naive']:>8.2f} {d['logp_vs_float64']:>9.2e} {d['entropy_vs_float64']:>9.2e} "
              f"{d['entropy_rel_vs_float64']:>9.2e} {d['grad_hidden_vs_naive']:>9.2e} "
              f"{d['grad_weight_vs_naive']:>9.2e} {d['grad_hidden_vs_float64']:>9.2e} "
              f"{d['grad_weight_vs_float64']:>9.2e}")
    print("|dlogp|, |dH|: max abs error vs a float64 reference (--reference-rows tokens); |dg_h|, |dg_W|: max abs "
          "diff of the gradients of hidden states and output weight vs naive; |g_h-64|, |g_W-64|: the same vs a "
          "float64 autograd reference over all tokens; /naive t: best time over naive's")
    print(f"float64 gradient scale (max abs): hidden {grad_scale['grad_hidden']:.3g}, "
          f"weight {grad_scale['grad_weight']:.3g}")
    record = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "logits_mib": logits_mb,
        "method": "fresh subprocess per variant; peak extra = VmHWM - VmRSS after reset via /proc/self/clear_refs",
        "results": results,
        "peak_extra_over_naive": {n: r["peak_extra_mb"] / naive_peak for n, r in results.items()},
        "max_abs_diff": diffs,
        "float64_grad_max_abs": grad_scale,
        "host": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "loadavg": os.getloadavg()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
