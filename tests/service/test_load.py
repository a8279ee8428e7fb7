"""A bounded load test: concurrent SDK clients on 127.0.0.1, each its own tenant; no update is lost
or applied twice, and every client's calls run in the order it issued them."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("tinker")

from tests.service.conftest import KEY_A, KEY_B, datum, tinker  # noqa: E402

types = tinker.types
CLIENTS, CYCLES = 3, 5


def test_concurrent_clients_lose_and_duplicate_no_update(server):
    steps: dict[int, list[int]] = {}
    losses: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            service = tinker.ServiceClient(base_url=server.url, api_key=(KEY_A, KEY_B)[index % 2])
            training = service.create_lora_training_client(base_model="tiny", rank=4, seed=index).result()
            data = [datum(training.get_tokenizer(), "12+7=19")]
            for _ in range(CYCLES):  # submitted back to back, awaited at the end: the server keeps the order
                forward = training.forward_backward(data, "cross_entropy")
                step = training.optim_step(types.AdamParams(learning_rate=1e-2))
                losses.setdefault(index, []).append(forward.result().metrics["loss:sum"])
                steps.setdefault(index, []).append(int(step.result().metrics["step:max"]))
        except BaseException as error:  # reported below, with the others' results
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for index in range(CLIENTS):
        assert steps[index] == list(range(1, CYCLES + 1))  # a lost update leaves a gap, a duplicate a repeat
        assert losses[index][-1] < losses[index][0]  # each trained its own adapter
    assert server.healthy()
