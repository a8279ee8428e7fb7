"""rlgraph vs TRL's GRPOTrainer: the same tiny model, data, reward and GRPO setting, alternated in one run.

    .venv/bin/python benchmarks/vs_trl.py --config small --steps 12 --out runs/bench/small.json
    .venv/bin/python benchmarks/vs_trl.py --config large --steps 6

The same code as `rlgraph bench` (`rlgraph/bench.py`, whose docstring says what is compared and
how); figures and their context are in docs/benchmarks.md ("rlgraph vs TRL").
"""

import sys

from rlgraph.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
