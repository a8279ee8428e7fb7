"""Write train.jsonl and test.jsonl: two-number sums as math word-free questions.

    python examples/math_grpo/make_data.py   # the files in this folder were written by this

Every pair (A, B) in [0, 99] appears once: 200 in test.jsonl, the rest in train.jsonl, split by a
seeded shuffle. Each row is {"question": "A+B=", "answer": "C"}: the fields the config maps.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(seed: int = 0, test_size: int = 200) -> None:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    for name, part in (("test.jsonl", rows[:test_size]), ("train.jsonl", rows[test_size:])):
        (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in part))


if __name__ == "__main__":
    main()
