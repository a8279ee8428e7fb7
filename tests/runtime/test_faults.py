"""Stuck workers: a rank that stops answering is named, and then nothing of the pool is left running.

Each test starts a 2-rank spmd transport (~5 s: two spawned processes import torch and build their
roles) with a short step timeout, stops rank 1 with SIGSTOP (a stopped process is alive but never
answers: the fault a dead-worker test does not cover) and checks what the controller sees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import attrs
import pytest
import torch

from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.errors import PlanStepError
from rlgraph.runtime.spmd import CLOSE_S, SpmdTransport
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.runtime.test_spmd import TOKENS, _compile

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0  # the step timeout under test: short, yet far above a tiny step's command (~0.1 s here)
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
    transport = SpmdTransport(compiled.plan, world, device="cpu", timeout_s=TIMEOUT_S)
    box.append(transport)
    workers = [process.pid for process in transport.processes]
    family = workers + [child.pid for pid in workers for child in psutil.Process(pid).children(recursive=True)]
    assert len(family) > len(workers)  # rank 1's child is there to be ended too
    start = time.monotonic()
    with pytest.raises(PlanStepError) as caught:
        PlanRunner(compiled, transport, controller=world.controller()).run(tiny_prompts(4))
    assert time.monotonic() - start < TIMEOUT_S + CLOSE_S + SLACK_S  # no wait without a bound
    message = str(caught.value)
    assert "failed on rank 1 " in message and "rank 1 stopped answering" in message and "SIGSTOP" in message
    assert "rank 0" not in message  # the healthy rank, blocked in a collective with rank 1, is not blamed
    assert caught.value.__cause__.rank == 1
    assert _gone(family) == []  # the stopped worker, the other one and rank 1's child


def test_close_ends_a_stopped_idle_worker_within_its_bound():
    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": length_parity_reward},
                      max_new_tokens=TOKENS)
    transport = SpmdTransport(_compile("grpo", n=4).plan, world, device="cpu", timeout_s=TIMEOUT_S)
    workers = [process.pid for process in transport.processes]
    os.kill(workers[1], signal.SIGSTOP)  # idle: it is sent `close`, which it never reads
    try:
        start = time.monotonic()
        transport.close()
        assert time.monotonic() - start < CLOSE_S + 2.0  # the stated bound, plus 2 s for the /proc scan and signals
        assert _gone(workers) == []
    finally:
        for pid in _gone(workers):
            os.kill(pid, signal.SIGKILL)


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


def test_rlgraph_train_names_a_stopped_rank_exits_non_zero_leaves_nothing_running_and_resumes(tmp_path):
    from tests.train.test_run import ROOT, make_config

    _, path = make_config(tmp_path, "run", runtime={"runtime": "spmd", "nproc": 2, "timeout_s": TIMEOUT_S},
                          train={"steps": 50, "seed": 0})  # far more steps than pass before the stop
    target, env = tmp_path / "run", {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "rlgraph", "train", str(path)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240  # the tests' bound for a tiny run's start and first step (test_run.py)
        while time.monotonic() < deadline and process.poll() is None and _steps_saved(target) < 1:
            time.sleep(0.1)  # the spmd workers start after the warm start, which checkpoints step 0
        assert process.poll() is None, process.stderr.read()[-2000:]
        servers = [child for child in psutil.Process(process.pid).children() if "forkserver" in " ".join(child.cmdline())]
        assert len(servers) == 1  # the ranks are forked by the run's fork server, in rank order: rank 1 is the later pid
        workers = sorted(child.pid for child in servers[0].children())
        assert len(workers) == 2
        family = workers + [child.pid for pid in workers for child in psutil.Process(pid).children(recursive=True)]
        stopped = time.monotonic()
        os.kill(workers[1], signal.SIGSTOP)
        _, errors = process.communicate(timeout=TIMEOUT_S + CLOSE_S + SLACK_S)
    finally:
        if process.poll() is None:  # bound the test even where the run hangs: end the run's session
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    assert time.monotonic() - stopped < TIMEOUT_S + CLOSE_S + SLACK_S
    assert process.returncode == 1, errors[-2000:]
    assert "failed on rank 1 " in errors and "stopped answering" in errors and "plan step [" in errors, errors[-2000:]
    assert "Traceback" not in errors  # one message, not a traceback from deep inside
    assert _gone(family) == []
    done_before = _steps_saved(target)
    resumed = subprocess.run([sys.executable, "-m", "rlgraph", "train", "--resume", str(target), "--runtime", "local",
                              "-o", f"train.steps={done_before + 1}"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _steps_saved(target) == done_before + 1  # it went on from the checkpoint


def _steps_saved(run_dir) -> int:
    """The step of the run's latest checkpoint (-1 before the first)."""
    from rlgraph.train.checkpoint import latest_checkpoint

    return int(latest_checkpoint(run_dir).name.split("-")[1]) if (run_dir / "latest").exists() else -1


def test_a_stopped_ray_actor_is_named_and_ended():
    ray = pytest.importorskip("ray", reason="the ray runtime is the optional extra rlgraph[ray] (make test installs it)")
    from rlgraph.runtime.ray_transport import PING_S, RayTransport

    compiled, box = _compile("grpo", n=4), []

    def reward_that_stops_rank_1(completions, **_):
        os.kill(box[0].pids[1], signal.SIGSTOP)
        return length_parity_reward(completions)

    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": reward_that_stops_rank_1},
                      max_new_tokens=TOKENS)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        transport = RayTransport(compiled.plan, world, device="cpu", timeout_s=TIMEOUT_S)
        box.append(transport)
        start = time.monotonic()
        with pytest.raises(PlanStepError) as caught:
            PlanRunner(compiled, transport, controller=world.controller()).run(tiny_prompts(4))
        assert time.monotonic() - start < TIMEOUT_S + PING_S + SLACK_S  # the timeout, one ping round, the step
        message = str(caught.value)
        assert "failed on rank 1 " in message and "rank 1 stopped answering" in message and "ping" in message
        assert "rank 0" not in message
        deadline = time.monotonic() + 10.0  # ray.kill returns at once; the raylet ends the process soon after
        while _gone(transport.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(transport.pids) == []
    finally:
        for pid in _gone(box[0].pids if box else []):
            os.kill(pid, signal.SIGKILL)  # where ray.kill did not end a stopped actor: never leave it behind
        ray.shutdown()
