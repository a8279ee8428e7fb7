"""Reward functions that attack the process they run in, for tests/rewards/test_reward_pool.py.

Module-level, so that reward workers import them by reference. Each takes the `answer` field
(unused or a marker) and returns one score per completion when it returns at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def good(completions, **_):
    return [float(len(text) % 3) / 2 for text in completions]


def kill_parent(completions, **_):
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(0.5)  # in a keeper-parented worker, PR_SET_PDEATHSIG kills us meanwhile
    return [1.0] * len(completions)


def stop_group(completions, **_):
    os.killpg(0, signal.SIGSTOP)
    return [1.0] * len(completions)


def busy_in_c(completions, **_):
    sum(range(10**13))  # one C call holding the GIL for hours
    return [1.0] * len(completions)


def allocate(completions, **_):
    blocks = []
    while True:
        blocks.append(bytearray(64 << 20))


def fork_child(completions, answer, **_):
    """Start `sleep` with the marker in its command line, in a session of its own, and return at once."""
    subprocess.Popen(["/bin/sh", "-c", f"sleep 300; : {answer[0]}"], start_new_session=True)
    return [1.0] * len(completions)


def raises(completions, **_):
    if any("boom" in text for text in completions):
        raise ValueError("no boom here")
    return [1.0] * len(completions)


def exits(completions, **_):
    sys.exit(3)


def kill_self(completions, **_):
    os.kill(os.getpid(), signal.SIGKILL)


def oversized_answer(completions, **_):
    """Write a frame header announcing a 1 TiB answer on the worker's own channel (its --fd)."""
    import struct

    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    os.write(fd, struct.pack("<Q", 1 << 40))
    time.sleep(30)


def garbage_answer(completions, **_):
    """Answer first on the worker's channel, with a frame that is not JSON."""
    import struct

    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    os.write(fd, struct.pack("<Q", 5) + b"hello")
    return [1.0] * len(completions)
