"""Write the shipped grade-school word problems (integer answers) as JSONL in the verl prompt layout.

    python tools/make_word_problems.py [--out-dir data/word_problems] [--seed 0]

Templated one- and two-step problems (addition, subtraction, multiplication, division without remainder,
two-step totals) over several story frames and small numbers, so that a 135M instruct model (SmolLM2)
solves some of them and RL has signal. Deterministic in --seed; train and validation questions are disjoint.
Each row: {"data_source": "word_problems", "prompt": [{"role": "user", "content": ...}],
"reward_model": {"style": "rule", "ground_truth": "<int>"}}.
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ("Tom", "Anna", "Maria", "Sam", "Lily", "Omar", "Ben", "Zoe", "Ravi", "Emma")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells")


def _add(r: random.Random) -> tuple[str, int]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 20), r.randint(2, 20)
    return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b


def _sub(r: random.Random) -> tuple[str, int]:
    name, item, a = r.choice(NAMES), r.choice(ITEMS), r.randint(8, 30)
    b = r.randint(1, a - 1)
    return f"{name} has {a} {item} and gives away {b} of them. How many {item} does {name} have left?", a - b


def _mul(r: random.Random) -> tuple[str, int]:
    item, a, b = r.choice(ITEMS), r.randint(2, 9), r.randint(2, 9)
    return f"There are {a} boxes. Each box holds {b} {item}. How many {item} are there in total?", a * b


def _div(r: random.Random) -> tuple[str, int]:
    name, item, k, each = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 6), r.randint(2, 9)
    return (f"{name} shares {k * each} {item} equally among {k} friends. How many {item} does each friend get?",
            each)


def _two_step(r: random.Random) -> tuple[str, int]:
    name, a, b, c = r.choice(NAMES), r.randint(5, 20), r.randint(2, 10), r.randint(1, 5)
    return (f"{name} buys {a} eggs on Monday and {b} eggs on Tuesday, then uses {c} eggs for a cake. "
            f"How many eggs are left?", a + b - c)


def _price(r: random.Random) -> tuple[str, int]:
    name, n, p = r.choice(NAMES), r.randint(2, 8), r.randint(2, 9)
    return f"A pen costs {p} dollars. {name} buys {n} pens. How many dollars does {name} pay?", n * p


TEMPLATES = (_add, _sub, _mul, _div, _two_step, _price)


def make_problems(count: int, rng: random.Random, seen: set[str]) -> list[dict]:
    """`count` distinct problems, cycling through TEMPLATES; questions already in `seen` are skipped."""
    rows: list[dict] = []
    i = 0
    while len(rows) < count:
        question, answer = TEMPLATES[i % len(TEMPLATES)](rng)
        i += 1
        if question in seen:
            continue
        seen.add(question)
        rows.append({"data_source": "word_problems", "prompt": [{"role": "user", "content": question}],
                     "reward_model": {"style": "rule", "ground_truth": str(answer)}})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="data/word_problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=480)
    parser.add_argument("--val", type=int, default=48)
    args = parser.parse_args(argv)
    rng, seen = random.Random(args.seed), set()
    os.makedirs(args.out_dir, exist_ok=True)
    for split, count in (("train", args.train), ("val", args.val)):
        path = os.path.join(args.out_dir, f"{split}.jsonl")
        with open(path, "w") as f:
            for row in make_problems(count, rng, seen):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {count} problems to {path}")


if __name__ == "__main__":
    main()
