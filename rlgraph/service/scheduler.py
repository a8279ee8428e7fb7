"""Runs the service's calls one at a time, fairly across tenants, each exactly once.

    scheduler = Scheduler()
    request_id = scheduler.submit("model-a", lambda: service.optim_step(...), key=("model-a", 7))
    scheduler.future(request_id).result()

- **Fair**: each tenant (a queue name: a model or sampler id) has its own FIFO queue; the worker
  takes one call from each non-empty queue in turn (round robin), so a tenant that submits a
  thousand calls delays another's next call by at most one call of its own.
- **In order**: one tenant's calls run in the order they were submitted (the Tinker SDK submits a
  training client's calls one after another, each after the previous was acknowledged).
- **Exactly once**: a call submitted with a `key` (model id, seq id) that was seen before is not
  queued again; the first call's request id is returned, so a client that retries after a lost
  reply gets the same result and the update is applied once. A call runs whether or not its
  client is still connected: the acknowledgement is the promise.
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

KEEP_RESULTS = 4096  # finished calls whose results stay retrievable


class Scheduler:
    def __init__(self, name: str = "rlgraph-service"):
        self._queues: dict[str, collections.deque[tuple[str, Callable[[], Any]]]] = {}
        self._ring: collections.deque[str] = collections.deque()  # tenants with pending calls, in turn order
        self._futures: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._keys: dict[Hashable, str] = {}
        self._counter = itertools.count()
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, queue: str, call: Callable[[], Any], *, key: Hashable | None = None) -> str:
        """Queue `call` on tenant `queue`; its request id (the first one's, for a repeated `key`)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if key is not None and key in self._keys:
                return self._keys[key]
            request_id = f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
            self._futures[request_id] = Future()
            if key is not None:
                self._keys[key] = request_id
            if queue not in self._queues or not self._queues[queue]:
                self._queues.setdefault(queue, collections.deque())
                self._ring.append(queue)
            self._queues[queue].append((request_id, call))
            self._lock.notify()
            self._forget_old()
            return request_id

    def future(self, request_id: str) -> Future | None:
        with self._lock:
            return self._futures.get(request_id)

    def run(self, queue: str, call: Callable[[], Any]) -> Any:
        """Submit and wait: the in-process client's blocking form."""
        return self.future(self.submit(queue, call)).result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=30)

    def _next(self) -> tuple[str, str, Callable[[], Any]] | None:
        with self._lock:
            while not self._ring and not self._closed:
                self._lock.wait()
            if not self._ring:
                return None
            queue = self._ring.popleft()
            request_id, call = self._queues[queue].popleft()
            if self._queues[queue]:
                self._ring.append(queue)  # its next call waits for every other tenant's turn
            return queue, request_id, call

    def _work(self) -> None:
        while (job := self._next()) is not None:
            _, request_id, call = job
            future = self._futures[request_id]
            try:
                future.set_result(call())
            except BaseException as error:  # the error is the call's result; the worker goes on
                future.set_exception(error)

    def _forget_old(self) -> None:
        """Drop the oldest finished results beyond KEEP_RESULTS (their keys too)."""
        while len(self._futures) > KEEP_RESULTS:
            oldest, future = next(iter(self._futures.items()))
            if not future.done():
                return
            del self._futures[oldest]
            for key in [k for k, v in self._keys.items() if v == oldest]:
                del self._keys[key]
