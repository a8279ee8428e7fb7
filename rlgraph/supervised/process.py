"""A supervised worker process: builds a handler from a recipe, then answers requests until killed.

Started by `rlgraph.supervised.pool.SupervisedPool` (never imported by the controller's own code paths):

    python -c "...; main()" --fd 3 --limits '{"RLIMIT_AS": ...}' [--keeper | --mount-proc]

Frames on the socket at `--fd`: an 8-byte little-endian length, then the payload. The controller
sends pickles (it is trusted): first ("build", factory, sys.path), where `factory()` builds the
handler (the reward terms: `rlgraph.rewards.reward_worker.ScoreTerms`; the environments of a
rollout: `rlgraph.agents.workers.EnvHost`), then requests, each answered by `handler(request)`.
The worker answers JSON only, so that nothing a reward or an environment writes there can run
code in the controller.

`--keeper` (hosts without PID namespaces): this process forks; the parent is a sacrificial
"keeper" that only waits, so `os.kill(os.getppid(), ...)` in a handler reaches the keeper, not the
controller, and the child dies with its keeper (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import traceback
from typing import Any

HEADER = struct.Struct("<Q")  # the payload's length in bytes
PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlgraph-worker")
    parser.add_argument("--fd", type=int)
    parser.add_argument("--limits", default="{}")
    parser.add_argument("--keeper", action="store_true")
    parser.add_argument("--mount-proc", action="store_true")
    parser.add_argument("--probe", action="store_true")  # print our PID (2 in a fresh namespace) and exit
    args = parser.parse_args(argv)
    if args.mount_proc:
        _mount_proc()
        if os.geteuid() != 0:
            _drop_capabilities()  # only there for the mount; bwrap (the `code` reward's) refuses to start with them
    if args.probe:
        print(os.getpid())
        return
    if args.keeper:
        _keep()  # returns in the worker (the child) only
    for name, value in json.loads(args.limits).items():
        resource.setrlimit(getattr(resource, name), (value, value))
    channel = socket.socket(fileno=args.fd)
    channel.setblocking(True)
    serve(channel)


def _keep() -> None:
    """Fork: the parent waits for the worker and exits as it did (128 + signal when killed, as bwrap does)."""
    _die_with_parent()  # the keeper dies with the controller
    child = os.fork()
    if child == 0:
        _die_with_parent()  # the worker dies with its keeper
        return
    for number in (signal.SIGINT, signal.SIGTERM):  # only SIGKILL from the controller ends the keeper
        signal.signal(number, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _mount_proc() -> None:
    """A /proc of our own PID namespace, mounted plainly. bwrap's `--proc` adds read-only submounts
    (sys, irq, bus), which keep a sandbox nested in this one (the `code` reward's) from mounting
    its own /proc; the host's /proc, left in place, names host PIDs that mean other processes here."""
    libc = ctypes.CDLL(None, use_errno=True)
    flags = 2 | 4 | 8  # MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot mount /proc for the worker's PID namespace: {os.strerror(error)}")


def _drop_capabilities() -> None:
    """capset(2) with every set empty: the CAP_SYS_ADMIN of our user namespace goes."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    if ctypes.CDLL(None, use_errno=True).capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "cannot drop the worker's capabilities")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the call: nothing would signal us
        os._exit(1)


def serve(channel: socket.socket) -> None:
    """Answer the controller's requests, one at a time, until it closes the channel or kills us."""
    handler: Any = None
    while True:
        request = _receive(channel)
        if request is None:
            return
        if request[0] == "build":
            sys.path[:] = request[2]  # the controller's: user modules import here as they did there
            try:
                handler = pickle.loads(request[1])()
                answer: Any = {"ready": os.getpid()}
            except BaseException as exc:  # reported to the controller, which names the recipe
                answer = {"error": describe_exception(exc)}
        else:
            answer = handler(request)
        try:
            payload = json.dumps(answer).encode()
        except (TypeError, ValueError) as exc:  # the handler's bug, not the run's: the controller refuses it
            payload = json.dumps({"unanswerable": f"{type(exc).__name__}: {exc}"}).encode()
        _send(channel, payload)


def describe_exception(exc: BaseException) -> str:
    """`Type: message (at file:line)`, the line being the innermost frame of its traceback."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:]
    at = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _receive(channel: socket.socket) -> Any:
    header = _read_exactly(channel, HEADER.size)
    if header is None:
        return None
    payload = _read_exactly(channel, HEADER.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)


def _read_exactly(channel: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = channel.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send(channel: socket.socket, payload: bytes) -> None:
    channel.sendall(HEADER.pack(len(payload)) + payload)


if __name__ == "__main__":
    main()
