import os

# Kernel parity tests run Triton under its CPU interpreter; it must be set before triton imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from rlgraph.testing import load_profile  # noqa: E402

torch.set_num_threads(1)  # two xdist workers on a 2-core machine
load_profile()  # "fast" (CI) unless HYPOTHESIS_PROFILE=thorough (nightly): see docs/testing.md
