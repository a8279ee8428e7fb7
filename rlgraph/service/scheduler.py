"""Runs the service's calls one at a time, fairly across tenants, each exactly once, within each
API key's quotas.

    scheduler = Scheduler()
    request_id = scheduler.submit("model-a", lambda: service.optim_step(...), key=("optim_step", "model-a", 7))
    scheduler.future(request_id).result()

- **Fair**: each tenant (a queue name: a model or sampler id) has its own FIFO queue; the worker
  takes one call from each non-empty queue in turn (round robin), so a tenant that submits a
  thousand calls delays another's next call by at most one call of its own.
- **In order**: one tenant's calls run in the order they were submitted (the Tinker SDK submits a
  training client's calls one after another, each after the previous was acknowledged).
- **Exactly once**: a call submitted with a `key` that was seen before is not queued again; the
  first call's request id is returned, so a client that retries after a lost reply gets the same
  result and the update is applied once. The key carries a `fingerprint` of the request: the same
  key with another request is a client's mistake (`KeyReused`), never a silent drop. A call runs
  whether or not its client is still connected: the acknowledgement is the promise.
- **Per-key quotas**: an owner (a digest of an API key) may have at most `max_queued` calls, and
  `max_queued_bytes` of request bodies, waiting or running (`QuotaExceeded` past either: HTTP 429,
  which the SDK retries later; one call alone always fits), and keeps its `keep_results` newest
  finished results, within `keep_bytes` of their requests' bodies (a result is no larger than its
  request: per-token values of the request's tokens); only its own oldest finished results are
  ever forgotten, so one key's flood never drops another key's result, pending or finished.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import uuid
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import attrs



class QuotaExceeded(RuntimeError):
    """An owner already has `max_queued` calls waiting: the call was not queued."""


class KeyReused(ValueError):
    """A call key seen before, with another request: the request id of the first and what it was."""


@attrs.define(eq=False)
class Call:
    request_id: str
    owner: str
    future: Future
    tag: Any = None  # what the caller keeps with the call (the HTTP layer: its result's encoder)
    key: Hashable | None = None
    fingerprint: Hashable | None = None
    size: int = 0  # its request body's bytes


class Scheduler:
    def __init__(self, name: str = "rlgraph-service", *, max_queued: float = math.inf, max_queued_bytes: float = math.inf,
                 keep_results: float = 4096, keep_bytes: float = math.inf):
        """Quotas per owner; the HTTP server passes its `Limits` (the in-process client, whose one
        owner is the operator, queues without bounds and keeps its 4,096 newest results)."""
        self.max_queued, self.max_queued_bytes = max_queued, max_queued_bytes
        self.keep_results, self.keep_bytes = keep_results, keep_bytes
        self._queues: dict[str, collections.deque[tuple[Call, Callable[[], Any]]]] = {}
        self._ring: collections.deque[str] = collections.deque()  # tenants with pending calls, in turn order
        self._calls: dict[str, Call] = {}
        self._owned: dict[str, collections.OrderedDict[str, Call]] = {}  # owner -> its calls, oldest first
        self._pending: collections.Counter[str] = collections.Counter()  # owner -> calls not finished
        self._pending_bytes: collections.Counter[str] = collections.Counter()  # owner -> their bodies' bytes
        self._kept_bytes: collections.Counter[str] = collections.Counter()  # owner -> bytes of all its calls kept
        self._keys: dict[Hashable, Call] = {}
        self._counter = itertools.count()
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, queue: str, call: Callable[[], Any], *, key: Hashable | None = None, owner: str = "local",
               tag: Any = None, fingerprint: Hashable | None = None, size: int = 0) -> str:
        """Queue `call` on tenant `queue` for `owner`; its request id (the first one's, for a repeated `key`)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if key is not None and key in self._keys:
                first = self._keys[key]
                if first.fingerprint != fingerprint:
                    raise KeyReused(first.request_id)
                return first.request_id
            if self._pending[owner] >= self.max_queued:
                raise QuotaExceeded(f"{self._pending[owner]} calls of this key are waiting or running, the server's "
                                    f"limit per key ({self.max_queued})")
            if self._pending[owner] and self._pending_bytes[owner] + size > self.max_queued_bytes:
                raise QuotaExceeded(f"the calls of this key waiting or running hold {self._pending_bytes[owner]} bytes "
                                    f"of requests; with this one's {size}, past the server's limit per key "
                                    f"({self.max_queued_bytes})")
            request_id = f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
            record = Call(request_id, owner, Future(), tag, key, fingerprint, size)
            self._calls[request_id] = record
            self._owned.setdefault(owner, collections.OrderedDict())[request_id] = record
            self._pending[owner] += 1
            self._pending_bytes[owner] += size
            self._kept_bytes[owner] += size
            if key is not None:
                self._keys[key] = record
            if queue not in self._queues or not self._queues[queue]:
                self._queues.setdefault(queue, collections.deque())
                self._ring.append(queue)
            self._queues[queue].append((record, call))
            self._lock.notify()
            self._forget_old(owner)
            return request_id

    def call(self, request_id: object) -> Call | None:
        with self._lock:
            return self._calls.get(request_id) if isinstance(request_id, str) else None

    def future(self, request_id: str) -> Future | None:
        record = self.call(request_id)
        return None if record is None else record.future

    def held(self, owner: str) -> tuple[int, int]:
        """(calls waiting or running, results kept) of `owner`."""
        with self._lock:
            return self._pending[owner], len(self._owned.get(owner, ()))

    def run(self, queue: str, call: Callable[[], Any], *, owner: str = "local") -> Any:
        """Submit and wait: the in-process client's blocking form."""
        return self.future(self.submit(queue, call, owner=owner)).result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=30)

    def _next(self) -> tuple[Call, Callable[[], Any]] | None:
        with self._lock:
            while not self._ring and not self._closed:
                self._lock.wait()
            if not self._ring:
                return None
            queue = self._ring.popleft()
            job = self._queues[queue].popleft()
            if self._queues[queue]:
                self._ring.append(queue)  # its next call waits for every other tenant's turn
            else:
                del self._queues[queue]  # a tenant's queue lives while it has calls (ids are the client's)
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            record, call = job
            try:
                record.future.set_result(call())
            except BaseException as error:  # the error is the call's result; the worker goes on
                record.future.set_exception(error)
            with self._lock:
                self._pending[record.owner] -= 1
                self._pending_bytes[record.owner] -= record.size
                self._forget_old(record.owner)

    def _forget_old(self, owner: str) -> None:
        """Drop `owner`'s oldest finished results past `keep_results` or `keep_bytes` (their keys
        too); never a pending one, never another owner's. Called with the lock held."""
        owned = self._owned.get(owner)
        if owned is None:
            return
        if len(owned) > self.keep_results or self._kept_bytes[owner] > self.keep_bytes:
            for request_id in [rid for rid, record in owned.items() if record.future.done()]:
                if len(owned) <= self.keep_results and self._kept_bytes[owner] <= self.keep_bytes:
                    break
                record = owned.pop(request_id)
                del self._calls[request_id]
                self._kept_bytes[owner] -= record.size
                if record.key is not None and self._keys.get(record.key) is record:
                    del self._keys[record.key]
        if not owned and not self._pending[owner]:
            del self._owned[owner]
            for counter in (self._pending, self._pending_bytes, self._kept_bytes):
                counter.pop(owner, None)
