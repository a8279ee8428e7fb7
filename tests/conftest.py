import os

# Kernel parity tests run Triton under its CPU interpreter; it must be set before triton imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Runs score in the controller unless a test asks for reward workers (tests/rewards/test_reward_pool.py):
# a pool costs ~1 s of start per run, which ~70 tiny runs would add to the suite.
os.environ.setdefault("RLGRAPH_REWARD_WORKERS", "0")

import torch  # noqa: E402

from rlgraph.testing import load_profile  # noqa: E402

torch.set_num_threads(1)  # two xdist workers on a 2-core machine
load_profile()  # "fast" (CI) unless HYPOTHESIS_PROFILE=thorough (nightly): see docs/testing.md
