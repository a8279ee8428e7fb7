"""`resolve_device`: which device a run's workers and models use; how the pool names the rank at fault."""

import pytest
import torch

from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.worker_pool import WorkerPool, resolve_device


def test_auto_is_cuda_only_where_torch_sees_a_gpu():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_on_a_machine_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(WorkerFailure, match="device 'cuda' was asked for, but torch sees no CUDA GPU here; "
                                            "use --device cpu or auto"):
        resolve_device("cuda")


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="auto, cpu or cuda, got 'gpu'"):
        resolve_device("gpu")


class ScriptedPool(WorkerPool):
    """The pool's bookkeeping over two scripted ranks: `answers` are what each poll returns in turn
    (nothing once they run out: a timeout), `stopped` the ranks whose process no longer runs."""

    def __init__(self, answers: list, stopped: dict[int, str]):
        self.world, self.timeout_s, self.device = 2, 0.01, "cpu"
        self._init_pool(None)
        self.answers, self.stopped, self.stops = list(answers), stopped, 0

    def _post(self, rank, command, args):
        return None

    def _poll(self, ranks, timeout):
        return self.answers.pop(0) if self.answers else []

    def _dead(self):
        return {}

    def _unresponsive(self, ranks):
        return {rank: how for rank, how in self.stopped.items() if rank in ranks}

    def _stop(self):
        self.stops += 1


def _fails(pool: ScriptedPool) -> WorkerFailure:
    """Rank 0 and 1 run a stage (pipelined); then only rank 0 is waited on, as a gather from it would."""
    pool.at_step("train step")
    pool.run("k", (0, 1), ("update",))
    pool.at_step("gather step")
    with pytest.raises(WorkerFailure) as caught:
        pool.fetch("metrics", 0)
    assert pool.stops == 1  # every worker is stopped after the failure
    return caught.value


def test_a_timeout_names_the_stopped_rank_not_the_waited_on_rank_blocked_with_it():
    failure = _fails(ScriptedPool([], {1: "its process 7 is stopped"}))
    assert failure.rank == 1 and failure.step == "train step"  # the command rank 1 never answered
    assert str(failure).startswith("rank 1 stopped answering: no answer to run within 0 s (its process 7 is stopped)")


def test_a_timeout_with_every_silent_rank_running_names_them_all():
    failure = _fails(ScriptedPool([], {}))
    assert failure.rank is None and "rank(s) [0, 1] did not finish run" in str(failure)


def test_a_collective_error_caused_by_a_stopped_peer_names_the_peer():
    timed_out = [(0, "error", ("DistBackendError", "Timed out waiting 3000ms for recv", "trace"))]
    failure = _fails(ScriptedPool([timed_out], {1: "its process 7 is stopped"}))
    assert failure.rank == 1 and failure.step == "train step"
    assert "rank 1 stopped answering during run (its process 7 is stopped); rank 0's collective then failed: " \
           "DistBackendError: Timed out" in str(failure)


def test_an_error_of_its_own_still_names_the_rank_that_raised_it():
    raised = [(0, "error", ("ValueError", "bad loss", "trace"))]  # rank 1, running, waits in a collective for rank 0
    failure = _fails(ScriptedPool([raised], {}))
    assert failure.rank == 0 and "rank 0 raised ValueError during run: bad loss" in str(failure)
