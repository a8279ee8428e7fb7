"""Reward terms in supervised worker processes (rlgraph/rewards/reward_pool.py): what a hostile or broken
reward does is scored by `reward_on_error`, the controller goes on, and no process outlives the pool.

The hostile rewards live in tests/rewards/hostile_rewards.py (module level: workers import them).
Each test runs in its own directory, so "no process left" is "no process whose cwd is that directory".
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import pytest

from rlgraph.errors import ConfigError, RewardError
from rlgraph.rewards import FormatRegex, RewardPipeline, RewardTerm, exact_match, math_reward
from rlgraph.rewards.reward_pool import RewardPool
from rlgraph.supervised.pool import pid_namespace_failure
from tests.rewards import hostile_rewards as hostile

ISOLATIONS = [pytest.param("pidns", marks=pytest.mark.skipif(pid_namespace_failure() is not None,
                                                               reason=f"no PID namespace here: {pid_namespace_failure()}")),
              "process"]
TEXT = ["p0", "p1", "p2"]
pytestmark = pytest.mark.slow  # worker processes (each test ~1-14 s)


def processes_in(directory: Path) -> list[int]:
    """PIDs (other than this one) whose working directory is `directory`: the pool's, and their children."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == str(directory):
                    found.append(int(entry))
            except OSError:
                pass  # gone meanwhile, or not ours to read
    return found


def processes_named(marker: str) -> list[int]:
    """PIDs whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            pass  # gone meanwhile
    return found


def within(seconds: float, check) -> bool:
    """Whether `check()` holds within `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def no_process_left(directory: Path, within_s: float = 5.0) -> list[int]:
    """The processes still there after `within_s` (the kernel tears a PID namespace down asynchronously)."""
    deadline = time.monotonic() + within_s
    while (left := processes_in(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pipeline(*fns, **options) -> RewardPipeline:
    # A long timeout by default: only the tests of hangs may time out, however loaded the machine.
    options = {"workers": 1, "timeout_s": 120.0, "memory_mb": 1200, **options}
    return RewardPipeline([RewardTerm(fn.__name__, fn) for fn in fns], **options)


def test_pooled_scores_equal_in_process_scores_bit_for_bit(here):
    rng = random.Random(0)
    answers = [str(rng.randint(-50, 50)) for _ in range(48)]
    completions = [rng.choice([f"\\boxed{{{a}}}", f"so {a}.5", f"#### {a}", "1/2", a, "no"]) for a in answers]
    terms = [RewardTerm("math", math_reward, 1.0), RewardTerm("format", FormatRegex(r"\d+$"), 0.1),
             RewardTerm("exact", exact_match, 0.3)]
    meta = {"answer": answers, "text": [f"q{i}" for i in range(48)]}
    alone = RewardPipeline(terms)
    pooled = RewardPipeline(terms, workers=2, timeout_s=30)
    try:
        for _ in range(2):
            assert pooled(completions, **meta) == alone(completions, **meta)  # the same floats, not close ones
        assert len(processes_in(here)) >= 2  # the workers are seen by the check below
        assert pooled.pop_metrics() == alone.pop_metrics()
    finally:
        pooled.close()
    assert no_process_left(here) == []


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_hostile_rewards_are_scored_zero_counted_and_leave_no_process(here, isolation):
    # The hangs get a short timeout; the others a long one, so that a loaded machine cannot time them out.
    hangs = pipeline(hostile.stop_group, hostile.busy_in_c, workers=2, timeout_s=1.5, on_error="zero",
                     isolation=isolation)
    attacks = [hostile.kill_parent, hostile.allocate, hostile.raises, hostile.exits, hostile.kill_self]
    rest = pipeline(hostile.good, *attacks, workers=2, timeout_s=120, on_error="zero", isolation=isolation)
    completions = ["a", "boom", "ccc"]
    contained = isolation == "pidns"  # kill(getppid()) reaches only the namespace's init, which ignores it
    try:
        assert hangs(completions, text=TEXT) == [0.0, 0.0, 0.0]
        metrics = hangs.pop_metrics()
        assert metrics["reward/stop_group/errors"] == metrics["reward/busy_in_c/errors"] == 3.0
        # Five attacks on two workers: the call goes on on replaced workers when both are dead.
        assert rest(completions, text=TEXT) == [x + (1.0 if contained else 0.0) for x in hostile.good(completions)]
        metrics = rest.pop_metrics()
        for attack in attacks:
            expected = 0.0 if attack is hostile.kill_parent and contained else 3.0
            assert metrics.get(f"reward/{attack.__name__}/errors", 0.0) == expected, attack.__name__
        failures = {**hangs.last_failures, **rest.last_failures}
        assert "timed out after 1.5 s" in failures["stop_group"] and "timed out after 1.5 s" in failures["busy_in_c"]
        assert "raised MemoryError" in failures["allocate"] and "raised ValueError: no boom" in failures["raises"]
        assert "exited with code 3" in failures["exits"]
        assert "killed by signal 9 (SIGKILL)" in failures["kill_self"]
        if not contained:
            assert "killed by signal 9 (SIGKILL)" in failures["kill_parent"]
    finally:
        hangs.close()
        rest.close()
    assert no_process_left(here) == []


@pytest.mark.skipif(pid_namespace_failure() is not None, reason="a setsid'd child escapes a worker without a PID namespace")
def test_a_child_in_its_own_session_dies_with_the_pool(here):
    rewards = pipeline(hostile.fork_child, isolation="pidns")
    marker = f"rlgraph-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        assert rewards(["x"], answer=[marker], text=["p"]) == [1.0]
        assert within(10, lambda: processes_named(marker))  # it outlived the call (once its `sh` has started)
    finally:
        rewards.close()
    assert no_process_left(here) == [] and within(5, lambda: not processes_named(marker))


@pytest.mark.parametrize("fn, problem", [
    (hostile.stop_group, r"'stop_group' timed out after 1 s \(reward_timeout_s\) \(its reward worker was killed"),
    (hostile.kill_self, r"'kill_self' killed by signal 9 \(SIGKILL\) in its reward worker"),
    (hostile.exits, r"'exits' exited with code 3 in its reward worker"),
    (hostile.raises, r"'raises' raised ValueError: no boom here \(at .*hostile_rewards.py:\d+ in raises\) on sample 1 "
                     r"of 3 \(prompt 'p1', completion 'boom'\)"),
    (hostile.oversized_answer, r"answered 1099511627776 bytes, over the cap of 67108864 bytes"),
    (hostile.garbage_answer, r"answered something other than scores on its channel"),
])
def test_the_fail_policy_names_the_reward_the_sample_and_what_happened(here, fn, problem):
    rewards = pipeline(fn, on_error="fail", **({"timeout_s": 1.0} if fn is hostile.stop_group else {}))
    try:
        with pytest.raises(RewardError, match=problem) as info:
            rewards(["a", "boom", "ccc"], text=TEXT)
        assert "reward_on_error: zero" in str(info.value)
    finally:
        rewards.close()
    assert no_process_left(here) == []


def test_bad_pool_settings_are_refused_naming_the_setting(monkeypatch):
    for workers in (-1, True, "2"):
        with pytest.raises(ConfigError, match="reward_workers="):
            RewardPipeline([RewardTerm("good", hostile.good)], workers=workers)
    for memory in (512, 1.5e3, None):  # below what importing torch takes, not whole, absent
        with pytest.raises(ConfigError, match="reward_memory_mb="):
            RewardPool(lambda: [], 1, memory_mb=memory)
    with pytest.raises(ConfigError, match="reward_isolation='chroot' is not one of auto, pidns, process"):
        RewardPool(list, 1, isolation="chroot")
    with pytest.raises(ConfigError, match="define each reward function at module level"):
        RewardPipeline([RewardTerm("inline", lambda completions, **_: [1.0] * len(completions))], workers=1)
    from rlgraph.rewards.reward_pool import default_workers

    monkeypatch.setenv("RLGRAPH_REWARD_WORKERS", "two")
    with pytest.raises(ConfigError, match="RLGRAPH_REWARD_WORKERS='two'"):
        default_workers()
    monkeypatch.delenv("RLGRAPH_REWARD_WORKERS")
    assert 1 <= default_workers() <= 4


def _broken_recipe():
    raise ImportError("no module named my_rewards")


def test_a_recipe_that_cannot_build_in_the_worker_is_a_reward_error(here):
    pool = RewardPool(_broken_recipe, 1, memory_mb=1200)
    with pytest.raises(RewardError, match="could not build the reward terms: ImportError: no module named my_rewards"):
        pool.run([(0, ["a"], {})], timeout_s=5)
    assert no_process_left(here) == []


HOSTILE_FILE = '''
import os, signal

def hostile(completions, **_):
    os.kill(os.getppid(), signal.SIGKILL)  # the controller, were it our parent
    os.killpg(0, signal.SIGSTOP)           # the controller too, were it in our process group
    return [1.0] * len(completions)
'''


def test_a_training_run_whose_reward_attacks_the_controller_completes(here):
    from tests.train.test_run import make_config, metrics_of
    from rlgraph.train.run import train

    (here / "my_rewards.py").write_text(HOSTILE_FILE)
    overrides = ["reward_workers=1", "reward_timeout_s=2", "reward_on_error=zero", "warm_start.steps=0",
                 "data.eval_fraction=0", "train.steps=2",
                 "rewards=[{name: math}, {name: 'my_rewards.py:hostile', weight: 0.1}]"]
    config, _ = make_config(here, "run", overrides)
    result = train(config)
    assert result.steps == 2
    steps = [row for row in metrics_of(here / "run") if "reward" in row]
    assert [row["reward/hostile/errors"] for row in steps] == [16.0, 16.0]  # N = 4 prompts x n=4
    assert all(row["reward/hostile"] == 0.0 and "reward/math" in row for row in steps)
    plan = (here / "run" / "plan.txt").read_text()
    assert "reward functions on the controller's reward pool: 1 process (" in plan and "timeout 2 s" in plan
    assert no_process_left(here) == []


def test_the_code_reward_scores_in_a_worker_as_in_the_controller(here):
    """The code reward's own sandbox (bubblewrap) runs nested in a reward worker, with the same verdicts."""
    import sys

    from rlgraph.rewards import CodeTests
    from rlgraph.rewards.sandbox import bwrap_failure

    if bwrap_failure(sys.executable) is not None:
        pytest.skip(f"the code sandbox cannot run here: {bwrap_failure(sys.executable)}")
    fence = "```python\n{}\n```"
    completions = [fence.format("def add(a, b):\n    return a + b"), fence.format("def add(a, b):\n    return a - b"),
                   fence.format("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b): return a + b")]
    meta = {"tests": ["assert add(1, 2) == 3\nassert add(2, 2) == 4"] * 3, "text": TEXT}
    pooled = RewardPipeline([RewardTerm("code", CodeTests(timeout_s=20))], workers=1, timeout_s=120)
    try:
        assert pooled(completions, **meta) == [1.0, 0.0, 1.0]
    finally:
        pooled.close()
    assert no_process_left(here) == []


def test_a_worker_that_died_between_calls_is_replaced_before_the_next(here):
    rewards = pipeline(hostile.good)
    try:
        assert rewards(["a"], text=["p"]) == [0.5]
        (dead,) = rewards.pool.pids()
        os.killpg(dead, 9)  # as a reward's background thread calling os._exit, or the OOM killer, would
        time.sleep(0.2)  # it has died (reaped by the pool on the next call)
        assert rewards(["a", "bb"], text=["p", "q"]) == [0.5, 1.0]  # no failure charged to this call
        assert rewards.pop_metrics()["reward/errors"] == 0.0 and rewards.pool.pids() != [dead]
    finally:
        rewards.close()
    assert no_process_left(here) == []


ATTACKS_FILE = '''
from rlgraph.rewards import CodeTests

MARKER = {marker!r}
ATTACKS = [
    "import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)\\ndef add(a, b): return 0",
    "import os, signal\\nos.kill(os.getppid(), signal.SIGSTOP)\\ndef add(a, b): return 0",
    "import os, signal\\nos.kill(-1, signal.SIGKILL)\\ndef add(a, b): return 0",
    "import os, signal\\nos.kill(os.getpid(), signal.SIGSTOP)\\ndef add(a, b): return 3",
    "while True: pass",
    "import os\\nif os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n"
    "        os.execv('/bin/sh', ['sh', '-c', 'sleep 300; : ' + MARKER])\\n    os._exit(0)\\ndef add(a, b): return 0",
    "import os\\nfor _ in range(400):\\n    if os.fork() == 0:\\n        import time; time.sleep(60)\\n"
    "def add(a, b): return 3",
    "blob = bytearray(4 * 1024**3)\\ndef add(a, b): return 3",
]
CODE = CodeTests(timeout_s=1.5)


def code_attacks(completions, **_):
    """The code reward facing the attacks as if the policy had written them (completion i: attack i mod 8)."""
    attacks = ["```python\\n" + ATTACKS[i % len(ATTACKS)] + "\\n```" for i in range(len(completions))]
    return CODE(attacks, tests=["assert add(1, 2) == 3"] * len(completions))
'''


def test_a_training_run_whose_code_reward_faces_the_attacks_completes(here):
    """Issue 25, done when: the attacks score 0, the run completes, and no process survives it."""
    import sys

    from rlgraph.rewards.sandbox import bwrap_failure
    from rlgraph.train.run import train
    from tests.train.test_run import make_config, metrics_of

    if bwrap_failure(sys.executable) is not None:
        pytest.skip(f"the code sandbox cannot run here: {bwrap_failure(sys.executable)}")
    marker = f"rlgraph-daemon-{os.getpid()}-{time.monotonic_ns()}"
    (here / "attacked.py").write_text(ATTACKS_FILE.format(marker=marker))
    overrides = ["reward_workers=1", "reward_timeout_s=120", "warm_start.steps=0", "data.eval_fraction=0",
                 "train.steps=1", "rewards=[{name: math}, {name: 'attacked.py:code_attacks', weight: 0.1}]"]
    config, _ = make_config(here, "run", overrides)
    assert train(config).steps == 1
    (row,) = [row for row in metrics_of(here / "run") if "reward" in row]
    assert row["reward/code_attacks"] == 0.0 and row["reward/errors"] == 0.0  # scored, not failed
    assert no_process_left(here) == []

    assert within(5, lambda: not processes_named(marker))  # the setsid'd daemon's `sh` names the marker


def test_a_run_stopped_by_a_failing_reward_leaves_no_worker(here):
    from rlgraph.train.run import train
    from tests.train.test_run import make_config

    (here / "my_rewards.py").write_text("def broken(completions, **_):\n    raise RuntimeError('grader down')\n")
    overrides = ["reward_workers=2", "warm_start.steps=0", "data.eval_fraction=0", "train.steps=2",
                 "rewards=[{name: math}, {name: 'my_rewards.py:broken'}]"]
    config, _ = make_config(here, "run", overrides)
    with pytest.raises(RewardError, match=r"reward 'broken' raised RuntimeError: grader down"):
        train(config)
    assert no_process_left(here) == []


@pytest.mark.parametrize("frame", [b'{"scores": [1.0, NaN, 1.0]}', b'{"scores": [1.0, Infinity, -Infinity]}',
                                   b'{"problem": "x", "rows": [0], "partial": [0.0, NaN, 1.0], "raised": false}'])
def test_a_workers_json_nan_is_caught_where_it_enters_the_controller(frame, monkeypatch):
    """Issue 34, item 16: JSON carries NaN and Infinity; the controller's check refuses them as scores
    (the worker's frame as the pool parses it: no process is started), so no NaN reaches a reward,
    an accuracy or summary.json."""
    import json

    from rlgraph.supervised.pool import SupervisedPool

    monkeypatch.setattr(SupervisedPool, "run", lambda self, payloads, timeout_s, **kw: [json.loads(frame)])
    zero = pipeline(hostile.good, on_error="zero")
    scores = zero(["a", "bb", "ccc"], text=TEXT)
    assert all(math.isfinite(x) for x in scores) and scores[1] == 0.0
    metrics = zero.pop_metrics()
    assert metrics["reward/good/errors"] >= 1 and all(math.isfinite(v) for v in metrics.values())
    with pytest.raises(RewardError, match=r"'good' (its reward worker answered (nan|inf) \(not finite\) on sample 1|x on sample 0 of 3 .*"
                                        r"; 2 samples affected)"):
        pipeline(hostile.good, on_error="fail")(["a", "bb", "ccc"], text=TEXT)


@pytest.mark.parametrize("program, used, limit, starting", [
    # slow but working (a loaded machine): its CPU time grows, and stays under the limit
    ("import time\nwhile True: time.sleep(0.01); sum(range(20000))", 0.1, 60.0, True),
    ("import time\ntime.sleep(60)", 0.0, 60.0, False),  # blocked: no CPU progress in a whole period
    ("while True: pass", 0.6, 0.5, False),              # a runaway: over the limit's CPU seconds
])
def test_a_start_is_late_when_it_stops_using_cpu_or_uses_too_much_not_when_the_machine_is_busy(program, used, limit,
                                                                                            starting):
    """A worker start is ~7 CPU seconds of imports, which a loaded machine stretches to minutes of
    wall time; past its deadline a start is judged by the CPU time of the worker's process tree (here
    a shell and its child python), not by the clock. `used`: CPU seconds to wait for first."""
    import socket
    import subprocess
    import sys

    from rlgraph.supervised.pool import _cpu_seconds, _Worker

    process = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0"', program], start_new_session=True)
    ours, theirs = socket.socketpair()
    worker = _Worker(process, ours, 0)
    worker.starting = True
    try:
        time.sleep(0.5)  # the interpreter's own start is CPU too: count from after it
        worker.cpu_mark = _cpu_seconds(process.pid)
        assert within(60, lambda: _cpu_seconds(process.pid) >= worker.cpu_mark + used)
        time.sleep(0.5)
        assert worker.still_starting(worker.cpu_mark + limit) is starting
    finally:
        theirs.close()
        worker.kill()
