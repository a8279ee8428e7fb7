"""Saved states live in --state-dir and survive a restart of the server."""

from __future__ import annotations

import pytest

import torch

pytest.importorskip("tinker")

from tests.service.conftest import KEY_A, KEY_B, RunningServer, datum, tinker

types = tinker.types


def test_a_state_saved_before_a_restart_loads_identically_after_it(tmp_path):
    first = RunningServer(tmp_path)
    try:
        client = tinker.ServiceClient(base_url=first.url, api_key=KEY_A)
        training = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        data = [datum(training.get_tokenizer(), text) for text in ("12+7=19", "3+4=7")]
        for _ in range(2):
            training.forward_backward(data, "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = training.save_state("before-restart").result().path
        tenant = first.service.tenants[training.model_id]
        adapter = first.service.base.adapter_state(tenant.adapter)
        optimizer = tenant.optimizer.state_dict()
        reference = training.forward(data, "cross_entropy").result()
    finally:
        first.stop()
    second = RunningServer(tmp_path)  # a new process's worth of state: only the directory is shared
    try:
        client = tinker.ServiceClient(base_url=second.url, api_key=KEY_A)
        restored = client.create_training_client_from_state_with_optimizer(path).result()
        tenant = second.service.tenants[restored.model_id]
        assert all(torch.equal(tensor, second.service.base.adapter_state(tenant.adapter)[name])
                   for name, tensor in adapter.items())
        state = tenant.optimizer.state_dict()
        assert all(torch.equal(state["state"][i][key], optimizer["state"][i][key])
                   for i in optimizer["state"] for key in ("exp_avg", "exp_avg_sq", "step"))
        assert restored.forward(data, "cross_entropy").result().metrics == reference.metrics
        # ownership survives too: the other key still cannot load it
        other = tinker.ServiceClient(base_url=second.url, api_key=KEY_B)
        try:
            other.create_training_client_from_state(path).result()
            raise AssertionError("another key loaded the state")
        except tinker.NotFoundError:
            pass
    finally:
        second.stop()
