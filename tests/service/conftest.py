"""A real `rlgraph serve` app on 127.0.0.1 with a random free port, in this process (uvicorn in a
thread), and the official tinker SDK pointed at it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rlgraph.runtime.spmd import free_port  # one helper for a free port on 127.0.0.1

try:
    import tinker  # the `service` extra; the modules that drive the SDK skip without it
except ImportError:  # pragma: no cover - make installs the extra
    tinker = None

KEY_A = "tml-" + "a" * 32
KEY_B = "tml-" + "b" * 32


class RunningServer:
    """uvicorn serving `build_app(Service(...))` until `stop()`; `url` is its base URL."""

    def __init__(self, state_dir: Path, keys: set[str] | None = frozenset({KEY_A, KEY_B}), *,
                 limits: dict | None = None, **service_kwargs):
        """`limits`: fields of the service's `Limits` to change (small limits for tests of them)."""
        import attrs
        import uvicorn

        from rlgraph.service.core import Service
        from rlgraph.service.http import build_app

        self.service = Service("tiny", state_dir=state_dir, **service_kwargs)
        self.service.limits = attrs.evolve(self.service.limits, **(limits or {}))
        self.app = build_app(self.service, keys)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.server.scheduler.close()
        self.service.close()  # the worker ranks of a server on spmd

    def healthy(self) -> bool:
        import httpx

        return httpx.get(f"{self.url}/api/v1/healthz", timeout=10).json() == {"status": "ok"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = RunningServer(tmp_path_factory.mktemp("states"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client_a(server):
    return tinker.ServiceClient(base_url=server.url, api_key=KEY_A)


@pytest.fixture(scope="module")
def client_b(server):
    return tinker.ServiceClient(base_url=server.url, api_key=KEY_B)


def datum(tokenizer, text: str, *, answer_from: int | None = None):
    """A supervised Tinker datum of `text`: input = seq[:-1], target = seq[1:], weight 1 from
    character `answer_from` on (every token when None)."""
    from tinker import types

    seq = tokenizer.encode(text)
    start = 0 if answer_from is None else answer_from
    weights = [1.0 if i + 1 >= start else 0.0 for i in range(len(seq) - 1)]
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": weights})
