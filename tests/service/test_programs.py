"""Every service call runs as a compiled plan (`rlgraph/service/programs.py`), the plan `plan(call)`
shows; the plan path computes what hand-written torch computes, bit for bit."""

from __future__ import annotations

import httpx
import pytest
import torch

from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.service import programs
from rlgraph.service.client import LocalServiceClient
from rlgraph.service.core import SampleParams, Service
from rlgraph.service.datums import Datum, check_datums, to_rollouts
from rlgraph.service.errors import CallError
from rlgraph.service.losses import make_loss
from rlgraph.service.tenants import LoraSpec


@pytest.fixture()
def local(tmp_path):
    client = LocalServiceClient("tiny", state_dir=tmp_path)
    yield client
    client.scheduler.close()


def rl_data(service: Service, texts=("12+7=19", "3+4=7", "10+10=20")) -> list[Datum]:
    data = []
    for i, text in enumerate(texts):
        seq = service.base.tokenizer.encode(text)
        steps = len(seq) - 1
        data.append(Datum(seq[:-1], {"target_tokens": seq[1:], "logprobs": [-1.0 - 0.1 * i] * steps,
                                     "advantages": [(-1.0) ** i * 0.5] * steps}))
    return data


def test_every_call_runs_the_plan_that_plan_of_the_call_shows(local, monkeypatch):
    ran = []

    class Recording(programs.PlanRunner):
        def run(self, batch, **kwargs):
            ran.append(self.compiled)
            return super().run(batch, **kwargs)

    monkeypatch.setattr(programs, "PlanRunner", Recording)
    training = local.create_lora_training_client("tiny", rank=4).result()
    data = rl_data(local.service)
    training.forward(data, "ppo").result()
    training.forward_backward(data, "importance_sampling").result()
    training.optim_step({"learning_rate": 1e-3, "grad_clip_norm": 1.0}).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = SampleParams(max_tokens=3, temperature=0.5)
    sampler.sample([5, 6, 7], 2, params, include_prompt_logprobs=True).result()
    sampler.compute_logprobs([5, 6, 7]).result()
    plan = local.service.plan
    mine = dict(owner=local.owner, model_id=training.model_id)
    expected = [plan("forward", loss_fn="ppo", **mine), plan("forward_backward", loss_fn="importance_sampling", **mine),
                plan("optim_step", adam_params={"learning_rate": 1e-3, "grad_clip_norm": 1.0}, **mine),
                plan("sample", num_samples=2, sampling_params=params, prompt_length=3, include_prompt_logprobs=True),
                plan("compute_logprobs")]
    # The very compiled objects: each (call, settings) is compiled once and the call runs that plan.
    assert [id(c) for c in ran] == [id(c) for plans in expected for _, c in plans]
    assert [name for plans in expected for name, _ in plans] == [
        "forward", "forward_backward", "optim_step", "sample", "prompt_logprobs", "sample", "prompt_logprobs"]


def test_plan_text_shows_the_accumulating_update_the_loss_and_the_step(local):
    training = local.create_lora_training_client("tiny", rank=4).result()
    text = training.plan("forward_backward", loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.9})
    assert "update[epochs=1 minibatches=1 micro_batch_size=None grad_clip=None" in text
    assert "step=False outputs=True] policy data" in text
    assert "tinker_loss[loss_fn='ppo' config={'clip_low_threshold': 0.9, 'clip_high_threshold': 1.2}]" in text
    assert "gradients accumulated, no optimizer step; per-token outputs returned" in text
    step = training.plan("optim_step", adam_params={"learning_rate": 3e-4, "grad_clip_norm": 0.5})
    assert "optimizer_step[lr=0.0003 betas=(0.9, 0.95) eps=1e-12 weight_decay=0.0 grad_clip=0.5] policy" in step
    # Sized as the tenant's rank-4 adapter (fp32 grads, two AdamW moments), not the whole model:
    adapter = 4 * sum(p.numel() for p in local.service.tenants[training.model_id].params) / 1024  # KiB
    assert f"grads {adapter:.1f} KiB, optimizer {2 * adapter:.1f} KiB" in step
    sampled = local.plan("sample", num_samples=4, sampling_params={"max_tokens": 5, "stop": ["\n"]})
    assert "generate[n=4 temperature=1.0 top_p=1.0 max_new_tokens=5 stop=('\\n',)] policy prompt" in sampled
    assert "4 samples (1 prompts x n=4), <= 5 new tokens" in sampled  # a sample plan is sized as its call


@pytest.mark.parametrize("call, settings, field", [
    ("train", {}, "call"),
    ("forward_backward", {}, "model_id"),
    ("optim_step", {"model_id": "someone-else:train:0"}, "model_id"),
    ("forward_backward", {"model_id": "mine", "loss_fn": "nope"}, "loss_fn"),
    ("forward_backward", {"model_id": "mine", "loss_fn": "dro"}, "loss_fn_config.beta"),
    ("optim_step", {"model_id": "mine", "adam_params": {"learning_rate": -1.0}}, "adam_params.learning_rate"),
    ("sample", {"num_samples": 0}, "num_samples"),
    ("sample", {"sampling_params": {"top_k": 5}}, "sampling_params.top_k"),
])
def test_plan_of_a_bad_call_names_the_field(local, call, settings, field):
    if settings.get("model_id") == "mine":
        settings = {**settings, "model_id": local.create_lora_training_client("tiny", rank=4).result().model_id}
    with pytest.raises(CallError) as caught:
        local.plan(call, **settings)
    assert caught.value.field == field


def test_a_forward_backward_and_step_equal_hand_written_torch_bit_for_bit(tmp_path):
    service = Service("tiny", state_dir=tmp_path / "a")
    service.create_model("o", "m", "tiny", LoraSpec(rank=4, seed=3))
    data = rl_data(service)
    result = service.forward("o", "m", data, "importance_sampling", backward=True)
    service.optim_step("o", "m", {"learning_rate": 1e-2})

    # The same arithmetic by hand: the train-mode forward, Tinker's summed loss, backward, AdamW.
    by_hand = Service("tiny", state_dir=tmp_path / "b")
    by_hand.create_model("o", "m", "tiny", LoraSpec(rank=4, seed=3))
    tenant = by_hand.tenants["m"]
    checked = check_datums(data, "importance_sampling", by_hand.limits)
    rollouts, batch = to_rollouts(checked, by_hand.base.tokenizer.pad_token_id)
    with by_hand.base.active(tenant.adapter):
        by_hand.base.module.train()
        lp = sequence_logprobs(by_hand.base.module, rollouts)  # [N, T]
        loss, per_token = make_loss("importance_sampling", {}, batch)(lp)
        loss.backward()
    for group in tenant.optimizer.param_groups:
        group.update(lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    tenant.optimizer.step()

    assert result["metrics"]["loss:sum"] == float(loss.detach())
    for i, (tokens, _) in enumerate(checked):
        assert torch.equal(result["outputs"][i]["logprobs"], lp[i, :len(tokens)].detach())
        assert torch.equal(result["outputs"][i]["elementwise_loss"], per_token[i, :len(tokens)].detach())
    planned, manual = service.base.adapter_state(service.tenants["m"].adapter), by_hand.base.adapter_state(tenant.adapter)
    assert all(torch.equal(planned[name], manual[name]) for name in manual)


def test_the_http_plan_is_the_in_process_plan_and_bad_bodies_name_the_field(server):
    pytest.importorskip("tinker")  # the server speaks the SDK's types (the `service` extra)
    from tests.service.conftest import KEY_A, KEY_B

    def post(body, key=KEY_A):
        headers = {"X-API-Key": key} if key else {}
        return httpx.post(f"{server.url}/rlgraph/v1/plan", json=body, headers=headers, timeout=60)

    from rlgraph.service.http import owner_of

    server.service.create_model(owner_of(KEY_A), "plan-a", "tiny", LoraSpec(rank=8, train_mlp=False))
    answer = post({"call": "forward_backward", "model_id": "plan-a", "loss_fn": "cispo",
                   "loss_fn_config": {"clip_high_threshold": 1.3}})
    assert answer.status_code == 200
    expected = programs.as_text(server.service.plan("forward_backward", owner=owner_of(KEY_A), model_id="plan-a",
                                                    loss_fn="cispo", loss_fn_config={"clip_high_threshold": 1.3}))
    assert answer.json()["text"] == expected and answer.json()["plans"][0]["name"] == "forward_backward"
    assert [p["name"] for p in post({"call": "compute_logprobs"}).json()["plans"]] == ["sample", "prompt_logprobs"]
    for body, status, field in [
        ({"call": "forward_backward", "model_id": "plan-a", "loss_fn": "gspo"}, 400, "loss_fn"),  # in process only
        ({"call": "forward_backward"}, 400, "model_id"),
        ({"call": 3}, 400, "call"),
        ({"call": "optim"}, 400, "call"),
        ({"call": "sample", "num_samples": "4"}, 400, "num_samples"),
        ({"call": "sample", "num_samples": 1000}, 413, "num_samples"),
        ({"call": "sample", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
        ({"call": "sample", "sampling_params": {"colour": 1}}, 400, "sampling_params.colour"),
        ({"call": "sample", "prompt_length": 0}, 400, "prompt_length"),
        ({"call": "optim_step", "model_id": "plan-a", "adam_params": {"beta1": 1.5}}, 400, "adam_params.beta1"),
        ({"call": "optim_step", "extra": 1}, 400, "extra"),
    ]:
        answer = post(body)
        assert (answer.status_code, answer.json().get("field")) == (status, field), (body, answer.json())
    assert post({"call": "sample"}, key=None).status_code == 401
    assert post({"call": "optim_step", "model_id": "plan-a"}, key=KEY_B).status_code == 404  # another key's model
    assert server.healthy()
