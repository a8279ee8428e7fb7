"""The HTTP server's bounds on what a client sends, on a server with small limits: bodies counted as
they are read, JSON depth, per-key quotas, repeat detection by call and request, and client
mistakes answered 4xx (which the SDK does not retry), never 500."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("tinker")

from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from tests.service.conftest import KEY_A, KEY_B, RunningServer, tinker  # noqa: E402

SMALL = dict(max_body_bytes=64 * 1024, body_seconds=0.5, max_json_depth=8, max_queued_calls=4, max_kept_results=6,
             max_sessions=3)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    running = RunningServer(tmp_path_factory.mktemp("small"), limits=SMALL)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def models(small):
    """A training model of key A and one of key B."""
    return {key: tinker.ServiceClient(base_url=small.url, api_key=key).create_lora_training_client("tiny", rank=2)
            .result().model_id for key in (KEY_A, KEY_B)}


HTTP = httpx.Client(timeout=30)  # one connection pool: a new client per request costs ~50 ms here


def post(server, route: str, body, key: str = KEY_A, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(f"{server.url}/api/v1/{route}", content=content,
                     headers={"X-API-Key": key, "Content-Type": kwargs.pop("type", "application/json")}, **kwargs)


def result(server, answer: httpx.Response, key: str = KEY_A) -> httpx.Response:
    assert answer.status_code == 200, answer.text
    return post(server, "retrieve_future", {"request_id": answer.json()["request_id"]}, key)


def raw_request(server, head: str, chunks, *, wait: float = 10.0) -> bytes:
    """Send `head` then each of `chunks` (stopping once the server answers); the first bytes of its answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as raw:
        raw.sendall(head.encode())
        for chunk in chunks:
            if select.select([raw], [], [], 0)[0]:
                break  # the server answered (and stopped reading)
            try:
                raw.sendall(chunk)
            except OSError:  # it closed the connection after answering
                break
        try:
            return raw.recv(4096)  # its status line (the connection may be reset right after: unread bytes)
        except ConnectionResetError:
            return b""


def test_a_chunked_body_is_cut_at_the_limit_as_it_is_read(small):
    """Issue 34 item 2: the body limit read only Content-Length; a 100 MB chunked body was parsed in full."""
    piece = b"x" * 8192
    chunks = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(64))  # 512 KiB, 8x the limit
    head = (f"POST /api/v1/optim_step HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    answer = raw_request(small, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert small.healthy()


def test_a_trickled_body_is_cut_after_body_seconds(small):
    start = time.perf_counter()
    head = f"POST /api/v1/optim_step HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\nContent-Length: 100\r\n\r\n{{"
    answer = raw_request(small, head, [])
    assert answer.startswith(b"HTTP/1.1 408") and time.perf_counter() - start < 5
    assert small.healthy()


@pytest.mark.parametrize("route", ["optim_step", "session_heartbeat", "retrieve_future"])
def test_deeply_nested_json_is_a_400(small, route):
    """Issue 34 item 8: deeply nested JSON answered 500 (RecursionError)."""
    for body in (b"[" * 30_000 + b"]" * 30_000, json.dumps({"a": [[[[[[[[[1]]]]]]]]]}).encode()):
        answer = post(small, route, body)
        assert (answer.status_code, answer.json()["field"]) == (400, "body"), answer.text
        assert "nests deeper than 8" in answer.json()["error"]


def test_client_mistakes_are_4xx_never_500(small, models):
    """Issue 34 item 8, and the same probe on every JSON route: bad types where ids and numbers go."""
    model = models[KEY_A]
    seq_list = post(small, "optim_step", {"model_id": model, "seq_id": [1], "adam_params": {}})
    assert (seq_list.status_code, seq_list.json()["field"]) == (400, "seq_id")
    heartbeat = post(small, "session_heartbeat", {"session_id": ["x"]})
    assert heartbeat.status_code == 410
    routes = ["create_model", "get_info", "optim_step", "save_weights", "load_weights", "save_weights_for_sampler",
              "create_sampling_session", "asample", "retrieve_future", "session_heartbeat", "forward_backward"]
    bodies = [[], "text", 7, {"model_id": [model], "seq_id": {"a": 1}, "session_id": {}, "request_id": [1]},
              {"model_id": model, "seq_id": 1.5, "adam_params": [], "path": {"x": 1}}]
    for route in routes:
        for body in bodies:
            answer = post(small, route, body)
            assert 400 <= answer.status_code < 500 and answer.status_code not in (408, 409, 429), (route, body, answer.text)
    assert small.healthy()


def fb_proto(model_id: str, seq_id: int, text: str = "1+2=3") -> bytes:
    tokens = [ord(c) % 40 + 3 for c in text]
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.asarray(tokens[1:], np.int64).tobytes(),
                                                             dtype=pb.DTYPE_INT64, shape=[len(tokens) - 1]))
    return message.SerializeToString()


def test_repeat_detection_is_per_call_type_and_request(small, models):
    """Issue 34 item 7: a forward_backward and an optim_step with one seq_id: the step never ran and
    answered a 500 TypeError; calls without a seq_id were dropped as repeats."""
    model = models[KEY_A]
    steps = small.service.tenants[model].steps
    forward = post(small, "forward_backward", fb_proto(model, 900), type="application/x-protobuf")
    step = post(small, "optim_step", {"model_id": model, "seq_id": 900, "adam_params": {"learning_rate": 1e-3}})
    assert forward.json()["request_id"] != step.json()["request_id"]
    assert result(small, forward).headers["content-type"] == "application/x-protobuf"
    assert result(small, step).json()["metrics"]["step:max"] == steps + 1
    for _ in range(2):  # no seq_id: never taken for a repeat
        assert "metrics" in result(small, post(small, "optim_step", {"model_id": model, "adam_params": {}})).json()
    assert small.service.tenants[model].steps == steps + 3
    # the same seq_id: the same request is a retry (same id, run once), another request a 400
    retry = post(small, "optim_step", {"adam_params": {"learning_rate": 1e-3}, "seq_id": 900, "model_id": model})
    assert retry.json()["request_id"] == step.json()["request_id"]
    reused = post(small, "optim_step", {"model_id": model, "seq_id": 900, "adam_params": {"learning_rate": 0.5}})
    assert (reused.status_code, reused.json()["field"]) == (400, "seq_id") and "already used" in reused.json()["error"]
    again = post(small, "forward_backward", fb_proto(model, 900, "2+2=4"), type="application/x-protobuf")
    assert (again.status_code, again.json()["field"]) == (400, "seq_id")
    assert small.service.tenants[model].steps == steps + 3


def test_a_flood_gets_429_and_never_drops_another_keys_result(small, models):
    """Issue 34 item 4: one key's 8,300 optim_steps made another key's pending result a 404."""
    gate = threading.Event()
    small.app.state.server.scheduler.submit("gate", gate.wait, owner="test-gate")  # hold the worker
    try:
        victim = post(small, "optim_step", {"model_id": models[KEY_B], "adam_params": {}}, KEY_B)
        flood = [post(small, "optim_step", {"model_id": models[KEY_A], "adam_params": {}}) for _ in range(6)]
        assert [answer.status_code for answer in flood] == [200] * 4 + [429] * 2
        assert flood[-1].json()["field"] == "request" and "limit per key (4)" in flood[-1].json()["error"]
    finally:
        gate.set()
    assert all("metrics" in result(small, answer).json() for answer in flood[:4])  # the accepted ones all ran
    for _ in range(8):  # past the key's 6 kept results: its own oldest go
        result(small, post(small, "optim_step", {"model_id": models[KEY_A], "adam_params": {}}))
    assert result(small, flood[0]).status_code == 404
    assert "metrics" in result(small, victim, KEY_B).json()


def test_a_key_keeps_its_newest_sessions(small):
    sessions = [post(small, "create_session", {"tags": [], "sdk_version": "0"}).json()["session_id"] for _ in range(5)]
    beats = [post(small, "session_heartbeat", {"session_id": session}).status_code for session in sessions]
    assert beats == [410, 410, 200, 200, 200]
