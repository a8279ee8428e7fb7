"""The scheduler's per-key quotas and repeat detection: a key's flood is refused past its quota and
forgets only its own oldest finished results; a reused key with another request is refused."""

from __future__ import annotations

import threading

import pytest

from rlgraph.service.scheduler import KeyReused, QuotaExceeded, Scheduler


@pytest.fixture
def gated():
    """A scheduler with small quotas whose worker is held until `gate.set()`."""
    scheduler = Scheduler(max_queued=4, keep_results=3)
    gate = threading.Event()
    scheduler.submit("gate", gate.wait, owner="gatekeeper")
    yield scheduler, gate
    gate.set()
    scheduler.close()


def test_a_flood_is_refused_past_the_keys_queue_quota_and_others_still_queue(gated):
    scheduler, gate = gated
    for i in range(4):
        scheduler.submit("a", lambda i=i: i, owner="flood")
    with pytest.raises(QuotaExceeded, match="4 calls of this key"):
        scheduler.submit("a", lambda: 99, owner="flood")
    victim = scheduler.submit("b", lambda: "mine", owner="victim")  # another key is not affected
    gate.set()
    assert scheduler.future(victim).result(timeout=30) == "mine"
    scheduler.run("a", lambda: None, owner="victim")  # queued behind the flood's calls (FIFO): all finished
    assert scheduler.held("flood")[0] == 0
    scheduler.submit("a", lambda: 5, owner="flood")  # the key may queue again


def test_a_flood_never_drops_another_keys_result_pending_or_finished(gated):
    """Issue 34 item 4: 8,300 optim_steps of one key made another key's pending result a 404."""
    scheduler, gate = gated
    pending = scheduler.submit("b", lambda: "pending", owner="victim")
    gate.set()
    finished = scheduler.submit("b", lambda: "finished", owner="victim")
    assert scheduler.future(finished).result(timeout=30) == "finished"
    first = []
    for i in range(40):  # the flood: each waits for its result, so it stays under its queue quota
        request_id = scheduler.submit("a", lambda i=i: i, owner="flood")
        first.append(request_id)
        scheduler.future(request_id).result(timeout=30)
    assert scheduler.future(pending).result(timeout=30) == "pending" and scheduler.call(finished) is not None
    assert [scheduler.call(rid) is not None for rid in first] == [False] * 37 + [True] * 3  # its newest 3 kept
    scheduler.run("a", lambda: None, owner="victim")  # queued behind the flood's last call: its bookkeeping is done
    assert scheduler.held("flood") == (0, 3)


def test_a_repeated_key_is_a_retry_only_with_the_same_request(gated):
    scheduler, gate = gated
    first = scheduler.submit("m", lambda: 1, key=("optim_step", "m", 7), owner="o", fingerprint="body-1")
    assert scheduler.submit("m", lambda: 2, key=("optim_step", "m", 7), owner="o", fingerprint="body-1") == first
    with pytest.raises(KeyReused, match=first):
        scheduler.submit("m", lambda: 3, key=("optim_step", "m", 7), owner="o", fingerprint="body-2")
    other = scheduler.submit("m", lambda: 4, key=("forward_backward", "m", 7), owner="o", fingerprint="body-3")
    gate.set()
    assert other != first and scheduler.future(other).result(timeout=30) == 4


def test_the_bytes_of_queued_and_kept_calls_are_bounded_per_key():
    scheduler = Scheduler(max_queued_bytes=100, keep_bytes=250)
    gate = threading.Event()
    scheduler.submit("gate", gate.wait, owner="gatekeeper")
    try:
        big = scheduler.submit("a", lambda: "big", owner="o", size=500)  # one call alone always fits
        with pytest.raises(QuotaExceeded, match="hold 500 bytes"):
            scheduler.submit("a", lambda: "more", owner="o", size=1)
        scheduler.submit("b", lambda: "other", owner="p", size=60)  # another key's budget is its own
    finally:
        gate.set()
    assert scheduler.future(big).result(timeout=30) == "big"
    scheduler.run("a", lambda: None, owner="p")  # behind big on its queue: big is booked as finished
    calls = []
    for i in range(4):  # one at a time: two 90-byte calls at once would pass the 100-byte queue quota
        calls.append(scheduler.submit("a", lambda i=i: i, owner="o", size=90))
        scheduler.future(calls[-1]).result(timeout=30)
        scheduler.run("a", lambda: None, owner="p")  # o's call is booked as finished before its next
    # kept within 250 bytes: the 500-byte result went first, then the oldest 90s
    assert [scheduler.call(rid) is not None for rid in [big, *calls]] == [False, False, False, True, True]
    scheduler.close()
