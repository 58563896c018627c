"""Math-Verify verifications/s: serial on the main thread vs GraderPool on 2 workers.

Workload per repeat: ``questions`` fresh questions x 8 responses (a GRPO group shares one gold), answer
kinds integers / fractions / decimals / sqrt, correct in several forms and wrong; the "mixed" scenario
adds a few adversarial answers (power towers, a 5,000-character nested expression, binary junk).
Each repeat uses new questions, so the per-process gold-parse cache never carries over between runs.
Pool start-up (fork server + Math-Verify import) is reported separately and excluded from the rates, and
both sides grade one untimed warm-up batch first (steady state: the pool lives for the whole run).

Besides wall-clock rates, CPU seconds per item are measured (serial: ``time.process_time``; pool: the
workers' utime+stime from /proc plus the parent's process time). On a shared, oversubscribed box the
wall-clock speedup mostly reflects how much CPU the scheduler grants; ``cpu_bound_speedup_2_cores``
= workers x serial CPU/item / pool CPU/item is what the pool would reach with ``workers`` idle cores.
``*_cores_used`` = items/s x CPU s/item is the CPU share each side actually got. With the kernel's
autogroup scheduling (``sched_autogroup_enabled``, recorded) CPU is shared fairly between sessions, not
threads: the pool's processes share one session's share with the parent, so when other sessions keep the
cores busy the pool gets about the serial process's share and its wall-clock speedup stays near 1x.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/reward_throughput.py`` (writes bench/results/reward_throughput.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time

from exgrpo_megatron.reward.grader import GraderPool, score_response

GROUP_SIZE = 8
ADVERSARIAL = [
    "</think> \\boxed{9^{9^{9^{9}}}}",
    "</think> \\boxed{" + "(" * 2495 + "1" + ")" * 2495 + "}",
    "</think> \\boxed{10^{10^{10}}}",
    "</think> " + bytes(range(256)).decode("latin-1") * 8,
]


def make_group(rng: random.Random, kind: str) -> list[tuple[str, str, bool]]:
    """One question's 8 responses: about half correct (in varied forms), the rest wrong."""
    if kind == "int":
        n = rng.randint(2, 9999)
        gold, right, wrong = str(n), [f"\\boxed{{{n}}}", f"{n}", f"\\boxed{{{n}.0}}"], [f"\\boxed{{{n + 1}}}", "0"]
    elif kind == "fraction":
        p, q = rng.randint(1, 40), rng.randint(41, 97)
        gold = f"\\frac{{{p}}}{{{q}}}"
        right = [f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", f"\\boxed{{{p}/{q}}}", f"\\boxed{{\\dfrac{{{2 * p}}}{{{2 * q}}}}}"]
        wrong = [f"\\boxed{{\\frac{{{p + 1}}}{{{q}}}}}", f"\\boxed{{{q}/{p}}}"]
    elif kind == "decimal":
        cents = rng.randint(101, 99999)
        gold = f"{cents / 100:.2f}"
        right = [f"\\boxed{{{gold}}}", f"\\boxed{{\\frac{{{cents}}}{{100}}}}", f"the answer is {gold}"]
        wrong = [f"\\boxed{{{(cents + 7) / 100:.2f}}}", f"\\boxed{{{cents}}}"]
    else:  # sqrt
        a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
        gold = f"{a}\\sqrt{{{b}}}"
        right = [f"\\boxed{{\\sqrt{{{a * a * b}}}}}", f"\\boxed{{{a}\\sqrt{b}}}", f"\\boxed{{{a}\\sqrt{{{b}}}}}"]
        wrong = [f"\\boxed{{{a + 1}\\sqrt{{{b}}}}}", f"\\boxed{{\\sqrt{{{a * b}}}}}"]
    answers = [rng.choice(right) if i % 2 == 0 else rng.choice(wrong) for i in range(GROUP_SIZE)]
    return [(f"Some reasoning about the problem.</think>\nThe answer is {ans}.", gold, True) for ans in answers]


def make_items(seed: int, questions: int, adversarial: bool) -> list[tuple[str, str, bool]]:
    rng = random.Random(seed)
    items = [item for q in range(questions) for item in make_group(rng, ("int", "fraction", "decimal", "sqrt")[q % 4])]
    if adversarial:
        for k, text in enumerate(ADVERSARIAL):
            items.insert((k + 1) * len(items) // (len(ADVERSARIAL) + 1), (text, "3", True))
    return items


def run_serial(items, timeout_seconds: int) -> tuple[list[float], float, float]:
    """(rewards, wall seconds, CPU seconds) of grading ``items`` on this thread."""
    start, cpu_start = time.perf_counter(), time.process_time()
    rewards = [score_response(resp, gold, req, timeout_seconds) for resp, gold, req in items]
    return rewards, time.perf_counter() - start, time.process_time() - cpu_start


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_pool(pool: GraderPool, items) -> tuple[list[float], float, float, int]:
    """(rewards, wall seconds, CPU seconds of workers + parent, hard-deadline kills) of one batch."""
    pids = pool.worker_pids()
    cpu_before = sum(process_cpu_seconds(pid) for pid in pids) + time.process_time()
    result = pool.grade(items)
    if pool.worker_pids() != pids:  # a worker was replaced: its CPU time is lost, report NaN
        return result.rewards, result.seconds, float("nan"), result.n_timeouts_killed
    cpu_after = sum(process_cpu_seconds(pid) for pid in pids) + time.process_time()
    return result.rewards, result.seconds, cpu_after - cpu_before, result.n_timeouts_killed


def autogroup_enabled() -> bool | None:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=100, help="questions per repeat (x8 responses)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-seconds", type=int, default=1)
    parser.add_argument("--hard-deadline-seconds", type=float, default=5.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "reward_throughput.json"))
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)

    load_before = os.getloadavg()
    start = time.perf_counter()
    pool = GraderPool(args.workers, args.timeout_seconds, args.hard_deadline_seconds)
    pool.wait_ready()
    startup_seconds = time.perf_counter() - start
    warm_up = make_items(999_999, 8, adversarial=False)
    run_serial(warm_up, args.timeout_seconds)
    pool.grade(warm_up)

    scenarios = {}
    with pool:
        for name, adversarial in (("ordinary", False), ("mixed", True)):
            rows = []
            for rep in range(args.repeats):
                serial_items = make_items(1000 * rep + 2 * adversarial, args.questions, adversarial)
                pool_items = make_items(1000 * rep + 2 * adversarial + 1, args.questions, adversarial)
                serial_rewards, serial_s, serial_cpu = run_serial(serial_items, args.timeout_seconds)
                pool_rewards, pool_s, pool_cpu, kills = run_pool(pool, pool_items)
                # Untimed check that the pool grades the serial items identically. Math-Verify's timeouts are
                # wall-clock, so on an overloaded box a legitimate item can time out in one run only: count it.
                recheck = pool.grade(serial_items).rewards
                mismatches = [i for i, (a, b) in enumerate(zip(recheck, serial_rewards, strict=True)) if a != b]
                for i in mismatches:
                    print(f"reward mismatch serial={serial_rewards[i]} pool={recheck[i]}: {serial_items[i][:2]!r:.200}",
                          file=sys.stderr)
                serial_cpu_per_item, pool_cpu_per_item = serial_cpu / len(serial_items), pool_cpu / len(pool_items)
                rows.append({
                    "items": len(pool_items),
                    "serial_per_s": len(serial_items) / serial_s,
                    "pool_per_s": len(pool_items) / pool_s,
                    "speedup": (len(pool_items) / pool_s) / (len(serial_items) / serial_s),
                    "serial_cpu_ms_per_item": 1000 * serial_cpu_per_item,
                    "pool_cpu_ms_per_item": 1000 * pool_cpu_per_item,
                    "cpu_bound_speedup_2_cores": args.workers * serial_cpu_per_item / pool_cpu_per_item,
                    "serial_cores_used": serial_cpu / serial_s,
                    "pool_cores_used": pool_cpu / pool_s,
                    "mean_reward": sum(pool_rewards) / len(pool_rewards),
                    "n_timeouts_killed": kills,
                    "n_serial_vs_pool_reward_mismatches": len(mismatches),
                    "loadavg_1min": os.getloadavg()[0],
                })
            scenarios[name] = {
                "repeats": rows,
                "median_serial_per_s": statistics.median(r["serial_per_s"] for r in rows),
                "median_pool_per_s": statistics.median(r["pool_per_s"] for r in rows),
                "median_speedup": statistics.median(r["speedup"] for r in rows),
                "median_cpu_bound_speedup_2_cores": statistics.median(r["cpu_bound_speedup_2_cores"] for r in rows),
            }

    report = {
        "workers": args.workers,
        "timeout_seconds": args.timeout_seconds,
        "hard_deadline_seconds": args.hard_deadline_seconds,
        "questions_per_repeat": args.questions,
        "responses_per_question": GROUP_SIZE,
        "n_adversarial_in_mixed": len(ADVERSARIAL),
        "pool_startup_seconds": startup_seconds,
        "cpu_count": os.cpu_count(),
        "sched_autogroup_enabled": autogroup_enabled(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "python": sys.version.split()[0],
        "scenarios": scenarios,
    }
    print(f"pool start-up {startup_seconds:.2f} s; load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'scenario':<9} {'rep':>3} {'items':>5} {'serial/s':>8} {'pool/s':>7} {'speedup':>7} "
          f"{'cpu ms/it ser':>13} {'pool':>6} {'cpu-bound x':>11} {'cores ser':>9} {'pool':>5} {'kills':>5} "
          f"{'load':>5}")
    for name, sc in scenarios.items():
        for i, r in enumerate(sc["repeats"]):
            print(f"{name:<9} {i:>3} {r['items']:>5} {r['serial_per_s']:>8.0f} {r['pool_per_s']:>7.0f} "
                  f"{r['speedup']:>6.2f}x {r['serial_cpu_ms_per_item']:>13.2f} {r['pool_cpu_ms_per_item']:>6.2f} "
                  f"{r['cpu_bound_speedup_2_cores']:>10.2f}x {r['serial_cores_used']:>9.2f} "
                  f"{r['pool_cores_used']:>5.2f} {r['n_timeouts_killed']:>5} {r['loadavg_1min']:>5.1f}")
        print(f"{name:<9} {'med':>3} {'':>5} {sc['median_serial_per_s']:>8.0f} {sc['median_pool_per_s']:>7.0f} "
              f"{sc['median_speedup']:>6.2f}x {'':>13} {'':>6} {sc['median_cpu_bound_speedup_2_cores']:>10.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
