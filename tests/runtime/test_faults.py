"""Stuck workers: a rank that stops answering is named, and then nothing of the pool is left running.

Each test starts a 2-rank spmd transport (~5 s: two spawned processes import torch and build their
roles) with a short step timeout, stops rank 1 with SIGSTOP (a stopped process is alive but never
answers: the fault a dead-worker test does not cover) and checks what the controller sees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import attrs
import pytest
import torch

from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.plan_runner import PlanRunner, PlanStepError
from rlgraph.runtime.spmd import GRACE_S, KILL_WAIT_S, TERM_S, SpmdTransport, _tracker_pid
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.runtime.test_spmd import TOKENS, _compile

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0  # the step timeout under test: short, yet far above a tiny step's command (~0.1 s here)
CLOSE_S = GRACE_S + TERM_S + KILL_WAIT_S  # the bound spmd.py states for stopping every worker
SLACK_S = 15.0  # the rest of a tiny GRPO step (generation, reward) on a loaded 2-core machine


@attrs.frozen
class WorldWithAChild(WorldSpec):
    """Rank 1 starts a child process of its own, as a generation engine or a compile worker would."""

    def build(self, rank, plan, device):
        if rank == 1:
            subprocess.Popen(["sleep", "600"])
        return super().build(rank, plan, device)


def _gone(pids: list[int]) -> list[int]:
    """The pids of `pids` still running (a zombie has ended; only its parent's reaping is left)."""
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def test_a_stopped_rank_is_named_and_every_process_of_the_pool_ends():
    compiled, box = _compile("grpo", n=4), []

    def reward_that_stops_rank_1(completions, **_):  # mid-step, between rank 1's commands
        os.kill(box[0].processes[1].pid, signal.SIGSTOP)
        return length_parity_reward(completions)

    world = WorldWithAChild({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": reward_that_stops_rank_1},
                            max_new_tokens=TOKENS)
    started_tracker = _tracker_pid() is None
    transport = SpmdTransport(compiled.plan, world, device="cpu", timeout_s=TIMEOUT_S)
    box.append(transport)
    workers = [process.pid for process in transport.processes]
    family = workers + [child.pid for pid in workers for child in psutil.Process(pid).children(recursive=True)]
    assert len(family) > len(workers)  # rank 1's child is there to be ended too
    tracker = _tracker_pid()
    start = time.monotonic()
    with pytest.raises(PlanStepError) as caught:
        PlanRunner(compiled, transport, controller=world.controller()).run(tiny_prompts(4))
    assert time.monotonic() - start < TIMEOUT_S + CLOSE_S + SLACK_S  # no wait without a bound
    message = str(caught.value)
    assert "failed on rank 1 " in message and "rank(s) [1] stopped answering" in message and "SIGSTOP" in message
    assert "rank 0" not in message  # the healthy rank, blocked in a collective with rank 1, is not blamed
    assert caught.value.__cause__.rank == 1
    assert _gone(family) == []  # the stopped worker, the other one and rank 1's child
    if started_tracker:  # the pool's own resource tracker ended with it
        assert _gone([tracker]) == []


def test_a_command_a_stopped_rank_does_not_read_fails_within_the_timeout():
    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": length_parity_reward},
                      max_new_tokens=TOKENS)
    transport = SpmdTransport(_compile("grpo", n=4).plan, world, device="cpu", timeout_s=TIMEOUT_S)
    workers = [process.pid for process in transport.processes]
    os.kill(workers[1], signal.SIGSTOP)
    big = torch.zeros(2, 8 << 20, dtype=torch.uint8)  # 8 MiB per rank: far more than a socket pair buffers
    outcome = []

    def scatter():
        try:
            transport.scatter("big", big, ((0, 1), 2))
        except WorkerFailure as failure:
            outcome.append(failure)

    sender = threading.Thread(target=scatter, daemon=True)
    sender.start()
    sender.join(TIMEOUT_S + CLOSE_S + 10.0)  # the send's timeout, the close, and 10 s of scheduling slack
    try:
        assert not sender.is_alive(), "the send to a stopped worker blocked past its timeout"
        assert outcome and outcome[0].rank == 1 and "rank 1 could not be sent the scatter of big" in str(outcome[0])
        assert "stopped" in str(outcome[0])
        assert _gone(workers) == []
    finally:  # before the fix the send blocks for ever: end the workers so the thread and the test end
        for pid in _gone(workers):
            os.kill(pid, signal.SIGKILL)
        sender.join(5.0)
