import os

# Kernel parity tests run Triton under its CPU interpreter; it must be set before triton imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Runs score in the controller unless a test asks for reward workers (tests/rewards/test_reward_pool.py):
# a pool costs ~1 s of start per run, which ~70 tiny runs would add to the suite.
os.environ.setdefault("RLGRAPH_REWARD_WORKERS", "0")
# Processes the tests start (`rlgraph train`/`serve` subprocesses, scripts) read it as their torch
# thread count: one each, like the worker that started them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray starts its workers at niceness 15: beside the other xdist worker (niceness 0) a test's actors
# then get a few percent of a core (the Ray train test: 257 s alone at load 6, 70 s with 0).
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from rlgraph.testing import load_profile  # noqa: E402

torch.set_num_threads(1)  # two xdist workers on a 2-core machine
load_profile()  # "fast" (CI) unless HYPOTHESIS_PROFILE=thorough (nightly): see docs/testing.md


@pytest.fixture(autouse=True)
def _forget_user_files_after_each_test():
    """A test that loads a user's file by path must not make the later tests of its worker send that file
    to their ranks (`rlgraph.user_files` remembers what this process loaded, as a run should)."""
    from rlgraph import user_files

    loaded = dict(user_files._LOADED)
    yield
    user_files._LOADED.clear()
    user_files._LOADED.update(loaded)


@pytest.fixture(autouse=True)
def _one_torch_thread_after_each_test():
    """A run whose config asks for more threads (`runtime.threads`, the demo's 2) sets them for the whole
    process; without this the worker's later tests run on them too and fight the other xdist worker."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


# The modules of the longest tests (the slowest first, by `make test --durations`), run before the
# rest. `-n 2 --dist worksteal` hands each worker half the collection in order and an idle worker
# steals the *last* pending tests of the other, so a minutes-long test left near the end runs alone
# while the other core idles; started first, the short tests fill in around it. A module's tests
# stay together (in their order), so its module-scoped fixtures are still built once.
LONGEST_FIRST = (
    "tests/test_examples.py",                  # the calculator agent and math GRPO learning tests
    "tests/service/test_examples.py",          # the service GRPO loop learning test
    "tests/train/test_run.py",                 # Ray and spmd runs
    "tests/runtime/test_spmd.py",
    "tests/runtime/test_faults.py",
    "tests/plan/test_memory.py",
    "tests/runtime/test_spmd_lora.py",
    "tests/backends/test_decode_compile.py",
    "tests/test_gpu_check.py",
    "tests/testing/test_broken.py",
    "tests/backends/test_train_compile.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST)))  # stable
