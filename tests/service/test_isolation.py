"""Each API key owns its tenants; bad requests get a 4xx naming the field; the server stays healthy."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

pytest.importorskip("tinker")

from tests.service.conftest import KEY_A, KEY_B, datum, tinker

types = tinker.types


@pytest.fixture(scope="module")
def owned(server, client_a):
    """Key A's training client, a sampler of it, a saved state and saved sampler weights."""
    training = client_a.create_lora_training_client(base_model="tiny", rank=4).result()
    data = [datum(training.get_tokenizer(), "12+7=19")]
    training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("mine").result().path
    sampler_path = training.save_weights_for_sampler("mine").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    reference = training.forward(data, "cross_entropy").result().metrics
    return {"training": training, "data": data, "state": state, "sampler_path": sampler_path,
            "sampler_id": sampler._sampling_session_id, "reference": reference}


def post(server, route: str, body: dict, key: str | None = KEY_B, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.post(f"{server.url}/api/v1/{route}", json=body, headers=headers, timeout=30, **kwargs)


def session_of(server, key: str) -> str:
    return post(server, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0"}, key).json()["session_id"]


def test_another_key_cannot_read_train_sample_load_or_overwrite(server, client_b, owned):
    model_id = owned["training"].model_id
    session_b = session_of(server, KEY_B)
    attempts = {
        "read (get_info)": ("get_info", {"model_id": model_id}),
        "train (optim_step)": ("optim_step", {"model_id": model_id, "seq_id": 99, "adam_params": {"learning_rate": 1.0}}),
        "overwrite (save_state)": ("save_weights", {"model_id": model_id, "path": "mine", "seq_id": 99, "overwrite": True}),
        "overwrite (load_state into it)": ("load_weights", {"model_id": model_id, "path": owned["state"], "seq_id": 99,
                                                             "optimizer": True}),
        "load (its state)": ("load_weights", {"session_id": session_b, "model_seq_id": 0, "path": owned["state"],
                                              "optimizer": True}),
        "sample (its sampler)": ("asample", {"sampling_session_id": owned["sampler_id"], "seq_id": 0, "num_samples": 1,
                                             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 5]}]},
                                             "sampling_params": {"max_tokens": 2}}),
        "sample (its sampler weights)": ("create_sampling_session", {"session_id": session_b, "sampling_session_seq_id": 0,
                                                                     "model_path": owned["sampler_path"]}),
        "use its session": ("create_model", {"session_id": owned["training"].holder.get_session_id(), "model_seq_id": 50,
                                             "base_model": "tiny", "lora_config": {"rank": 4}}),
    }
    for what, (route, body) in attempts.items():
        answer = post(server, route, body)
        assert answer.status_code == 404, (what, answer.status_code, answer.text)
        assert "for this API key" in answer.json()["error"], what
        assert server.healthy()
    # ... and through the SDK, which raises with the server's message
    with pytest.raises(tinker.NotFoundError, match="no saved state"):
        client_b.create_training_client_from_state(owned["state"]).result()
    with pytest.raises(tinker.NotFoundError, match="no saved state"):
        client_b.create_sampling_client(model_path=owned["sampler_path"]).result()
    # B's own state of the same name is B's: A's is untouched
    own = client_b.create_lora_training_client(base_model="tiny", rank=4).result()
    assert own.save_state("mine").result().path != owned["state"]
    assert owned["training"].forward(owned["data"], "cross_entropy").result().metrics == owned["reference"]


def test_a_heartbeat_for_a_session_that_is_gone_or_not_yours_answers_410(server):
    session = session_of(server, KEY_A)
    assert post(server, "session_heartbeat", {"session_id": session}, KEY_A).json() == {"type": "session_heartbeat"}
    for key, session_id in ((KEY_B, session), (KEY_A, "from-before-a-restart"), (KEY_A, None)):
        answer = post(server, "session_heartbeat", {"session_id": session_id}, key)
        assert (answer.status_code, answer.json()["field"]) == (410, "session_id")


def test_requests_without_a_valid_key_are_refused(server):
    for key in (None, "tml-" + "z" * 32, ""):
        answer = post(server, "create_session", {"tags": [], "sdk_version": "0"}, key)
        assert answer.status_code == 401 and answer.json()["field"] == "X-API-Key"
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-" + "n" * 32).create_lora_training_client("tiny").result()
    assert server.healthy()


def test_bad_training_requests_name_the_field(server, client_a, owned):
    training, tokenizer = owned["training"], owned["training"].get_tokenizer()
    seq = tokenizer.encode("3+4=7")
    cases = [
        ([types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": [99] * 5})],
         "cross_entropy", None, "data[0].loss_fn_inputs.target_tokens"),  # outside the vocabulary
        ([types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                      loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0, 1.0]})],
         "cross_entropy", None, "data[0].loss_fn_inputs.weights"),  # one weight per token
        ([types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                      loss_fn_inputs={"target_tokens": seq[1:], "logprobs": [0.0] * 5,
                                      "advantages": [float("nan")] * 5})],
         "importance_sampling", None, "data[0].loss_fn_inputs.advantages"),  # NaN
        ([types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]})],
         "ppo", None, "data[0].loss_fn_inputs.logprobs"),  # ppo needs the sampler's log-probs
        (owned["data"], "ppo", {"clip_low_threshold": 1.5}, "loss_fn_config.clip_low_threshold"),
        (owned["data"], "dro", None, "loss_fn_config.beta"),
        (owned["data"], "cross_entropy", {"beta": 1.0}, "loss_fn_config.beta"),
        ([types.Datum(model_input=types.ModelInput.from_ints([1] * 70), loss_fn_inputs={"target_tokens": [1] * 70})],
         "cross_entropy", None, "data[0].model_input"),  # longer than the context
    ]
    for data, loss_fn, config, field in cases:
        with pytest.raises(tinker.BadRequestError if field != "data[0].model_input" else tinker.APIStatusError,
                           match=field.replace("[", r"\[").replace("]", r"\]")):
            client_a.create_lora_training_client("tiny", rank=4).result().forward_backward(data, loss_fn, config).result()
        assert server.healthy()
    # the owner's model is untouched by all of it
    assert training.forward(owned["data"], "cross_entropy").result().metrics == owned["reference"]


def test_bad_optimizer_sampling_and_model_requests_name_the_field(server, client_a, owned):
    model_id = owned["training"].model_id
    session = session_of(server, KEY_A)
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 5, 6]}]}
    sample = {"sampling_session_id": owned["sampler_id"], "seq_id": 1, "num_samples": 1, "prompt": prompt}
    cases = [
        ("optim_step", {"model_id": model_id, "seq_id": 1000, "adam_params": {"learning_rate": -1.0}}, 400,
         "adam_params.learning_rate"),
        ("optim_step", {"model_id": model_id, "seq_id": 1001, "adam_params": {"beta1": 1.0}}, 400, "adam_params.beta1"),
        ("optim_step", {"model_id": model_id, "seq_id": 1002}, 400, "adam_params"),
        ("asample", {**sample, "sampling_params": {"max_tokens": 2, "top_k": 5}}, 400, "sampling_params.top_k"),
        ("asample", {**sample, "sampling_params": {"max_tokens": 500}}, 413, "sampling_params.max_tokens"),
        ("asample", {**sample, "num_samples": 0, "sampling_params": {"max_tokens": 2}}, 400, "num_samples"),
        ("asample", {**sample, "sampling_params": {"max_tokens": 2, "temperature": -1}}, 400, "sampling_params.temperature"),
        ("asample", {**sample, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [500]}]},
                     "sampling_params": {"max_tokens": 2}}, 400, "prompt"),
        ("create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 0}},
         400, "lora_config.rank"),
        ("create_model", {"session_id": session, "model_seq_id": 1, "base_model": "llama-405b"}, 404, "base_model"),
        ("create_model", {"session_id": session, "model_seq_id": 2}, 400, "base_model"),
        ("save_weights", {"model_id": model_id, "path": "../escape", "seq_id": 1003}, 400, "path"),
        ("load_weights", {"model_id": model_id, "path": "/etc/passwd", "seq_id": 1004, "optimizer": False}, 400, "path"),
        ("retrieve_future", {"request_id": "req-nope"}, 404, "request_id"),
    ]
    for route, body, status, field in cases:
        answer = post(server, route, body, KEY_A)
        assert (answer.status_code, answer.json().get("field")) == (status, field), (route, answer.text)
        assert field in answer.json()["error"]
        assert server.healthy()
    garbage = httpx.post(f"{server.url}/api/v1/forward_backward", content=b"\xff\x00garbage", timeout=30,
                         headers={"X-API-Key": KEY_A, "Content-Type": "application/x-protobuf"})
    assert (garbage.status_code, garbage.json()["field"]) == (400, "body")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:  # a body announced as 1 GB
        raw.sendall(f"POST /api/v1/optim_step HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\n"
                    f"Content-Length: {10**9}\r\n\r\n{{}}".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 413")
    assert server.healthy()


def test_a_retried_call_is_applied_once_even_when_its_client_went_away(server, client_a):
    """The SDK retries a call whose reply it lost with the same seq_id; the server answers with the
    first call's request id and applies the update once. The first reply is never read (the client
    hung up), yet the call runs: its acknowledgement was the promise."""
    training = client_a.create_lora_training_client(base_model="tiny", rank=4).result()
    tenant = server.service.tenants[training.model_id]
    body = {"model_id": training.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:  # send, then hang up
        payload = json.dumps(body).encode()
        raw.sendall(f"POST /api/v1/optim_step HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        raw.recv(4096)
    retried = post(server, "optim_step", body, KEY_A).json()
    again = post(server, "optim_step", body, KEY_A).json()
    assert retried["request_id"] == again["request_id"]
    result = post(server, "retrieve_future", {"request_id": retried["request_id"]}, KEY_A).json()
    assert result["metrics"]["step:max"] == 1.0 and tenant.steps == 1
    stolen = post(server, "retrieve_future", {"request_id": retried["request_id"]}, KEY_B)  # another key's result
    assert stolen.status_code == 404 and stolen.json()["field"] == "request_id"


def test_a_server_bug_is_a_json_500_naming_it_without_a_traceback(server, owned, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(server.service, "info", broken)
    answer = post(server, "get_info", {"model_id": owned["training"].model_id}, KEY_A)
    assert answer.status_code == 500 and "Traceback" not in answer.text
    assert answer.json()["error"] == "the server failed on /api/v1/get_info: RuntimeError: simulated bug"
    monkeypatch.undo()
    assert server.healthy() and post(server, "get_info", {"model_id": owned["training"].model_id}, KEY_A).status_code == 200
