"""Real collectives (`rlgraph.runtime.distributed`) against the simulation (`collectives.shard`/`move`).

The route of a move is checked in one process over random layouts; then gloo jobs of 2 and 4
processes run every kind of collective and each process compares what it received with
`collectives.shard(value, dst)[its rank]`. One process group per job runs all its cases.
"""

from __future__ import annotations

import datetime
import os
import queue as queues
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st

from rlgraph.ir import specs as S
from rlgraph.runtime import collectives as C
from rlgraph.runtime import distributed as D
from rlgraph.runtime.spmd import worker_context

# The worker processes import this module: `rlgraph.testing` (which loads transformers, ~2 s a
# process) is imported inside the functions that only the parent runs.

CTRL = ("controller",)
JOB_SECONDS = 60  # a child that fails or hangs is reported after at most this long


def _process(layout: tuple, key) -> int:
    return 0 if key == C.CONTROLLER else key


def _key(layout: tuple, process: int):
    """The key of `collectives.shard(value, layout)` that process `process` plays (controller: process 0)."""
    return C.CONTROLLER if layout == CTRL and process == 0 else process


def _per_row(value) -> bool:
    return C._rows(value) is not None


# -- the route, simulated in one process --------------------------------------------------------------


def _simulate(value, src: tuple, dst: tuple) -> tuple[dict, int]:
    """Deliver `route`'s pieces in one process with `distributed`'s own assembly: {key: piece}, bytes sent."""
    header = D.header_of(value)
    held = {_process(src, key): D._fields(piece, header) for key, piece in C.shard(value, src).items()}
    have = {process: D._range_of(src, header.rows, process, 0) for process in held}
    pieces = D.route(src, dst, header.rows)
    received, sent = {}, 0
    for piece in pieces:
        if piece.local:
            continue
        for tag, field in enumerate(held[piece.source]):
            offset = have[piece.source][0]
            received[piece, tag] = field[piece.start - offset:piece.stop - offset]
            sent += received[piece, tag].numel() * received[piece, tag].element_size()
    out = {}
    for process in D._processes(dst, 0):
        mine = [p for p in pieces if p.dest == process]
        out[_key(dst, process)] = D._collect(header, mine, held.get(process, []), have.get(process), received,
                                             torch.device("cpu"))
    return out, sent


def test_the_route_delivers_every_shard_the_simulation_does():
    from rlgraph.testing.strategies import layouts

    @given(layouts(8), layouts(8), st.integers(0, 12), st.integers(1, 3))
    def prop(src, dst, rows, cols):
        if src == dst:
            return
        value = torch.arange(rows * cols).reshape(rows, cols)
        placed, sent = _simulate(value, src, dst)
        want = C.shard(value, dst)
        assert placed.keys() == want.keys()
        for key in want:
            assert C._same(placed[key], want[key]), (src, dst, key)
        assert sent == sum(_lacking_bytes(value, src, dst, p) for p in D._processes(dst, 0))  # nothing sent twice
        one_process_per_shard = all(layout == CTRL or len(layout[0]) == layout[1] for layout in (src, dst))
        if C.expected_kind(src, dst, True) == "all_to_all" and one_process_per_shard:
            assert sent == C.move(C.shard(value, src), src, dst, "all_to_all")[1]  # only rows a shard lacks move

    prop()


def test_the_route_of_records_and_scalars():
    from rlgraph.testing.plans import stand_in

    rollouts = stand_in(S.ROLLOUTS, rows=5)
    placed, _ = _simulate(rollouts, ((0, 1), 2), ((1, 2, 3), 3))
    assert all(C._same(placed[k], v) for k, v in C.shard(rollouts, ((1, 2, 3), 3)).items())
    placed, sent = _simulate(torch.tensor(2.5), CTRL, ((0, 1, 2), 1))
    assert all(torch.equal(piece, torch.tensor(2.5)) for piece in placed.values()) and sent == 2 * 4


def test_the_route_keeps_rows_a_process_already_holds():
    # 5 rows from 2 shards [0:3] [3:5] to 1 replica: each rank receives only the other's rows
    pieces = D.route(((0, 1), 2), ((0, 1), 1), 5)
    assert [p for p in pieces if not p.local] == [D.Piece(1, 0, 3, 5), D.Piece(0, 1, 0, 3)]


# -- real processes ------------------------------------------------------------------------------------


def _rows(count: int, cols: int = 2, dtype=torch.int64) -> torch.Tensor:
    return torch.arange(count * cols).reshape(count, cols).to(dtype)


def _cases(world: int) -> list[tuple]:
    """(src, dst, kind, value) moves for a job of `world` processes; process 0 is also the controller."""
    from rlgraph.testing.plans import stand_in

    five, rollouts = _rows(5), stand_in(S.ROLLOUTS, rows=5)
    prompts = stand_in(S.PROMPTS, rows=3)
    if world == 2:
        both = (0, 1)
        return [
            (CTRL, (both, 2), "scatter", five),
            (CTRL, (both, 1), "scatter", five),
            (CTRL, ((1,), 1), "scatter", _rows(4, 3, torch.float32)),
            (CTRL, (both, 1), "broadcast", torch.tensor(3.5)),
            ((both, 2), CTRL, "gather", five),
            ((both, 2), CTRL, "gather", _rows(6).reshape(3, 2, 2)),
            (((1,), 1), CTRL, "gather", five),
            ((both, 1), (both, 2), "all_to_all", five),
            ((both, 2), (both, 1), "all_to_all", five),
            ((both, 1), (both, 2), "all_to_all", _rows(1)),  # one row over two shards: one is empty
            ((both, 2), (both, 1), "all_to_all", _rows(0)),
            (((0,), 1), ((1,), 1), "send_recv", five % 2 == 0),
            (((1,), 1), ((0,), 1), "send_recv", five),
            (((1,), 1), ((0,), 1), "send_recv", torch.tensor(7)),
            (CTRL, (both, 2), "scatter", rollouts),
            ((both, 2), (both, 1), "all_to_all", rollouts),
            ((both, 2), CTRL, "gather", rollouts),
            (CTRL, (both, 2), "scatter", prompts),
        ]
    four, nine = (0, 1, 2, 3), _rows(9, 3, torch.float32)
    return [
        (CTRL, (four, 4), "scatter", _rows(7)),
        (CTRL, (four, 2), "scatter", _rows(7)),  # tensor-parallel pairs hold the same rows
        (CTRL, ((1, 2, 3), 1), "broadcast", torch.tensor(1.25)),
        ((four, 2), CTRL, "gather", _rows(7)),
        ((four, 4), CTRL, "gather", nine),
        ((four, 4), (four, 2), "all_to_all", nine),
        ((four, 2), (four, 4), "all_to_all", nine),
        ((four, 4), (four, 1), "all_to_all", _rows(5)),
        ((four, 1), (four, 4), "all_to_all", _rows(3)),  # 3 rows over 4 shards
        (((0, 1), 2), ((2, 3), 2), "send_recv", nine),
        (((0, 1), 1), ((2, 3), 2), "send_recv", nine),
        (((2, 3), 2), ((0, 1), 1), "send_recv", nine),
        (((0, 1, 2), 3), ((1, 2, 3), 1), "send_recv", nine),  # overlapping rank sets
        (((2, 3), 1), ((0, 1), 1), "send_recv", torch.tensor(4.0)),
        ((four, 4), ((2, 3), 1), "send_recv", stand_in(S.ROLLOUTS, rows=9)),
    ]


def _lacking_bytes(value, src: tuple, dst: tuple, process: int) -> int:
    """Bytes of the rows `process` must hold under `dst` but does not under `src` (by row identity)."""
    if process not in D._processes(dst, 0):
        return 0
    if C._rows(value) is None:
        return 0 if process in D._processes(src, 0) else C._nbytes(value)
    ids = torch.arange(C._rows(value))
    wanted = C.shard(ids, dst)[_key(dst, process)].tolist()
    held = C.shard(ids, src).get(_key(src, process), torch.arange(0)).tolist()
    return len(set(wanted) - set(held)) * C._nbytes(value) // max(C._rows(value), 1)


def _run_cases(process: int, cases: list[tuple]) -> list[tuple]:
    """Every case in this process: (index, received the right piece, bytes sent, bytes it lacked)."""
    results = []
    for index, (src, dst, kind, value) in enumerate(cases):
        mine = C.shard(value, src).get(_key(src, process))
        piece, sent = D.move_distributed(mine, src, dst, kind, per_row=_per_row(value))
        want = C.shard(value, dst).get(_key(dst, process))
        right = piece is None if want is None else piece is not None and C._same(piece, want)
        results.append((index, right, sent, _lacking_bytes(value, src, dst, process)))
    try:  # a wrong kind is refused on every process before any message
        D.move_distributed(None, CTRL, ((0, 1), 2), "gather", per_row=True)
        results.append(("wrong kind", False, 0, 0))
    except C.CollectiveError:
        results.append(("wrong kind", True, 0, 0))
    return results


def _worker(process: int, world: int, port: int, cases: list[tuple], reports) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=process, world_size=world, timeout=datetime.timedelta(seconds=JOB_SECONDS // 2))
        reports.put((process, _run_cases(process, cases), None))
    except BaseException:  # report, do not hang the parent
        reports.put((process, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_job(world: int, cases: list[tuple]) -> dict[int, list[tuple]]:
    """Run `cases` in `world` gloo processes; their results by process, or fail with a child's error."""
    context = worker_context()  # the spmd workers' fork server: torch imported once per test process
    reports = context.Queue()
    port = _free_port()
    children = [context.Process(target=_worker, args=(i, world, port, cases, reports), daemon=True)
                for i in range(world)]
    for child in children:
        child.start()
    try:
        return _collect_reports(world, reports, children)
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()


def _collect_reports(world: int, reports, children) -> dict[int, list[tuple]]:
    results: dict[int, list[tuple]] = {}
    deadline = time.monotonic() + JOB_SECONDS
    while len(results) < world:
        try:
            process, outcome, error = reports.get(timeout=1)
        except queues.Empty:
            dead = [i for i, child in enumerate(children) if child.exitcode is not None and i not in results]
            if dead:
                pytest.fail(f"process(es) {dead} of {world} died without a report (exit codes "
                            f"{[children[i].exitcode for i in dead]})")
            if time.monotonic() > deadline:
                pytest.fail(f"the {world}-process job is stuck: no result for {JOB_SECONDS} s "
                            f"(processes {sorted(results)} reported)")
            continue
        assert error is None, f"process {process} of {world} failed:\n{error}"
        results[process] = outcome
    return results


def _check_job(world: int) -> None:
    cases = _cases(world)
    results = _run_job(world, cases)
    for index, case in enumerate([*cases, "wrong kind"]):
        rows = [results[process][index] for process in range(world)]
        wrong = [process for process, (_, right, _, _) in enumerate(rows) if not right]
        assert not wrong, f"case {index} {case}: process(es) {wrong} did not get their shard"
        if index < len(cases):  # the bytes sent are exactly the rows destinations lacked
            assert sum(r[2] for r in rows) == sum(r[3] for r in rows), f"case {index} {case}"


@pytest.mark.slow
def test_two_gloo_processes_move_values_as_the_simulation_does():
    _check_job(2)


@pytest.mark.slow
def test_four_gloo_processes_move_values_as_the_simulation_does():
    _check_job(4)
