"""The service core without HTTP: scheduling, the non-finite guard, Tinker's loss formulas."""

from __future__ import annotations

import threading

import pytest
import torch

from rlgraph.service.client import LocalServiceClient
from rlgraph.service.datums import Datum
from rlgraph.service.errors import CallError
from rlgraph.service.losses import LossBatch, check_loss, make_loss
from rlgraph.service.scheduler import Scheduler
from rlgraph.service.tenants import LoraSpec


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    client = LocalServiceClient("tiny", state_dir=tmp_path_factory.mktemp("states"))
    yield client
    client.scheduler.close()


def sequence_datum(client, text: str, **inputs) -> Datum:
    seq = client.service.base.tokenizer.encode(text)
    return Datum(seq[:-1], {"target_tokens": seq[1:], **inputs})


def test_one_tenant_cannot_starve_another_and_each_keeps_its_order():
    scheduler = Scheduler()
    gate, order = threading.Event(), []
    scheduler.submit("busy", gate.wait)  # hold the worker until both tenants have queued
    busy = [scheduler.submit("busy", lambda i=i: order.append(("busy", i))) for i in range(20)]
    quiet = [scheduler.submit("quiet", lambda i=i: order.append(("quiet", i))) for i in range(2)]
    gate.set()
    for request_id in busy + quiet:
        scheduler.future(request_id).result(timeout=30)
    scheduler.close()
    # round robin: the quiet tenant's calls run 2nd and 4th, not after the busy tenant's twenty
    assert order.index(("quiet", 0)) <= 1 and order.index(("quiet", 1)) <= 3
    assert [i for who, i in order if who == "busy"] == list(range(20))


def test_a_repeated_call_key_runs_once_and_returns_the_first_result():
    scheduler = Scheduler()
    runs = []
    first = scheduler.submit("m", lambda: runs.append(1) or len(runs), key=("m", 7))
    again = scheduler.submit("m", lambda: runs.append(1) or len(runs), key=("m", 7))  # a client's retry
    assert again == first and scheduler.future(first).result(timeout=30) == 1
    scheduler.close()
    assert runs == [1]


def test_a_non_finite_loss_changes_nothing_of_any_tenant(local):
    victim = local.create_lora_training_client("tiny", rank=4, seed=0).result()
    other = local.create_lora_training_client("tiny", rank=4, seed=1).result()
    data = [sequence_datum(local, "12+7=19")]
    victim.forward_backward(data, "cross_entropy").result()  # pending gradients the failure must keep
    tenant = local.service.tenants[victim.model_id]
    grads = [p.grad.clone() for p in tenant.params]
    weights = [p.detach().clone() for p in tenant.params]
    other_before = other.forward(data, "cross_entropy").result().metrics
    length = len(data[0].tokens)
    # dro with a huge beta: 0.5 * 3e38 * (lp - q)^2 overflows fp32 to inf, so the gradient is not finite
    poison = [sequence_datum(local, "12+7=19", logprobs=[-30.0] * length, advantages=[1.0] * length)]
    with pytest.raises(CallError, match="not finite"):
        victim.forward_backward(poison, "dro", {"beta": 3e38}).result()
    assert all(torch.equal(p.grad, g) for p, g in zip(tenant.params, grads))
    assert all(torch.equal(p, w) for p, w in zip(tenant.params, weights))
    assert other.forward(data, "cross_entropy").result().metrics == other_before
    victim.optim_step({"learning_rate": 1e-3}).result()  # the tenant still trains


def batch_of(lp: torch.Tensor) -> tuple[LossBatch, torch.Tensor, torch.Tensor]:
    old = lp.detach() + torch.tensor([[0.3, -0.5, 0.0], [0.1, 0.0, 0.0]])  # [2, 3]
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])  # [2, 3]
    mask = torch.tensor([[True, True, True], [True, True, False]])  # [2, 3]
    return LossBatch(torch.zeros(2, 3, dtype=torch.long), mask, torch.ones(2, 3), old, adv), old, adv


@pytest.mark.parametrize("name, config", [("importance_sampling", {}), ("ppo", {"clip_low_threshold": 0.7}),
                                          ("cispo", {"clip_high_threshold": 1.1}), ("dro", {"beta": 0.5})])
def test_losses_follow_tinkers_formulas(name, config):
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -9.0]], requires_grad=True)  # [2, 3]
    batch, old, adv = batch_of(lp)
    full = check_loss(name, config)
    loss, per_token = make_loss(name, full, batch)(lp)
    ratio = torch.exp(lp - old)  # [2, 3]
    low, high = full.get("clip_low_threshold"), full.get("clip_high_threshold")
    expected = {"importance_sampling": -ratio * adv,
                "ppo": -torch.minimum(ratio * adv, ratio.clamp(low or 0, high or 0) * adv),
                "cispo": -(ratio.clamp(low or 0, high or 0).detach() * adv * lp),
                "dro": -(adv * lp - 0.5 * 0.5 * (lp - old) ** 2)}[name].masked_fill(~batch.mask, 0.0)
    # the same fp32 ops in another order: equal within a few ulps of values of size ~10
    assert torch.allclose(per_token, expected, atol=1e-6)
    assert float(loss.detach()) == pytest.approx(float(expected.detach().sum()), abs=1e-5)
    assert per_token[1, 2] == 0  # a padded position adds nothing


@pytest.mark.parametrize("config, field", [({"clip_low_threshold": "x"}, "loss_fn_config.clip_low_threshold"),
                                           ({"clip_high_threshold": 0.5}, "loss_fn_config.clip_low_threshold"),
                                           ({"epsilon": 0.2}, "loss_fn_config.epsilon")])
def test_bad_loss_configs_name_the_key(config, field):
    with pytest.raises(CallError) as error:
        check_loss("ppo", config)
    assert error.value.field == field


def test_rlgraphs_registered_losses_are_usable_by_name_in_process(local):
    training = local.create_lora_training_client("tiny", rank=4).result()
    datum = sequence_datum(local, "3+4=7")
    length = len(datum.tokens)
    rl = Datum(datum.tokens, {**datum.loss_fn_inputs, "logprobs": [-3.0] * length, "advantages": [1.0] * length})
    result = training.forward([rl], "gspo", {"clip_low": 0.1}).result()
    assert torch.isfinite(torch.tensor(result.metrics["loss:sum"]))
    with pytest.raises(CallError, match="takes no keyword 'beta'"):
        training.forward([rl], "gspo", {"beta": 1.0}).result()
    with pytest.raises(CallError, match="unknown loss 'grpo_typo'"):
        training.forward([rl], "grpo_typo").result()


@pytest.mark.parametrize("kwargs, field", [({"rank": 0}, "lora_config.rank"), ({"rank": 1.5}, "lora_config.rank"),
                                           ({"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}, "lora_config"),
                                           ({"rank": 4, "seed": "a"}, "lora_config.seed")])
def test_bad_lora_configs_name_the_field(kwargs, field):
    with pytest.raises(CallError) as error:
        LoraSpec(**kwargs)
    assert error.value.field == field


def test_bad_adam_params_name_the_key(local):
    training = local.create_lora_training_client("tiny", rank=4).result()
    # issue 34 item 6: finite but absurd settings were accepted and wrote 11,264 non-finite adapter values
    for adam, field in [({"learning_rate": float("nan")}, "adam_params.learning_rate"), ({"eps": 0.0}, "adam_params.eps"),
                        ({"momentum": 0.9}, "adam_params.momentum"), ({"learning_rate": 1e308}, "adam_params.learning_rate"),
                        ({"weight_decay": 1e30}, "adam_params.weight_decay"), ({"eps": 1e300}, "adam_params.eps"),
                        ({"learning_rate": 0.5, "weight_decay": 3.0}, "adam_params.weight_decay"),
                        ({"grad_clip_norm": 1e300}, "adam_params.grad_clip_norm")]:
        with pytest.raises(CallError) as error:
            training.optim_step(adam).result()
        assert error.value.field == field


def test_a_model_keeps_its_newest_snapshots_and_a_key_its_quota(tmp_path):
    from rlgraph.service.core import SampleParams, Service
    from rlgraph.service.datums import Limits

    service = Service("tiny", state_dir=tmp_path)
    service.limits = Limits(service.base.vocab_size, service.base.context, max_models=2, max_samplers=5,
                            kept_snapshots=2)
    client = LocalServiceClient(service=service, state_dir=tmp_path)
    try:
        training = client.create_lora_training_client("tiny", rank=4).result()
        samplers = [training.save_weights_and_get_sampling_client().result() for _ in range(4)]
        adapters = set(service.base.module.peft_config)
        assert len(adapters) == 1 + 2  # the tenant's and its two newest snapshots: old ones are freed
        for old in samplers[:2]:
            with pytest.raises(CallError) as error:
                old.sample([1, 5], 1, SampleParams(max_tokens=1)).result()
            assert error.value.status == 404
        assert len(samplers[-1].sample([1, 5], 1, SampleParams(max_tokens=1)).result().sequences) == 1
        client.create_lora_training_client("tiny", rank=4).result()
        with pytest.raises(CallError, match="holds 2 training models") as error:
            client.create_lora_training_client("tiny", rank=4).result()
        assert error.value.field == "base_model"
        other = LocalServiceClient(service=service, scheduler=client.scheduler, state_dir=tmp_path, owner="other")
        other.create_lora_training_client("tiny", rank=4).result()  # the quota is per key
    finally:
        client.scheduler.close()


def test_sampling_stops_at_a_stop_token_or_string_and_says_so(local):
    from rlgraph.service.core import SampleParams

    training = local.create_lora_training_client("tiny", rank=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    tokenizer = local.service.base.tokenizer
    prompt = tokenizer.encode("12+7=")
    free = sampler.sample(prompt, 1, SampleParams(max_tokens=4, temperature=0.0)).result().sequences[0]
    assert free.stop_reason == ("stop" if free.tokens[-1] == tokenizer.eos_token_id else "length")
    second = free.tokens[1]
    by_id = sampler.sample(prompt, 1, SampleParams(max_tokens=4, temperature=0.0, stop=[second])).result().sequences[0]
    cut = free.tokens[:free.tokens.index(second) + 1]  # greedy: the same path, cut after the id's first occurrence
    assert (by_id.tokens, by_id.stop_reason) == (cut, "stop")
    text = tokenizer.decode([second])
    by_text = sampler.sample(prompt, 1, SampleParams(max_tokens=4, temperature=0.0, stop=text)).result().sequences[0]
    assert (by_text.tokens, by_text.stop_reason) == (cut, "stop")
    for bad in ([""], [1.5], {"a": 1}, ["7"] * 17, "x" * 257):  # the last two: past the bounds (a plan cache key)
        with pytest.raises(CallError) as error:
            sampler.sample(prompt, 1, SampleParams(max_tokens=2, stop=bad)).result()
        assert error.value.field == "sampling_params.stop"


def test_a_step_that_ends_non_finite_is_undone_and_reported(local, monkeypatch):
    """Issue 34 item 6: optim_step reported success with non-finite adapter values, which save_state
    then wrote. The step's result is checked; a non-finite one is undone (weights, AdamW state,
    gradients) and reported, and a non-finite saved adapter is refused on load."""
    training = local.create_lora_training_client("tiny", rank=4, seed=2).result()
    tenant = local.service.tenants[training.model_id]
    data = [sequence_datum(local, "12+7=19")]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step({"learning_rate": 1e-2}).result()  # AdamW now has state to restore
    training.forward_backward(data, "cross_entropy").result()
    params = [param.detach().clone() for param in tenant.params]
    grads = [param.grad.clone() for param in tenant.params]
    moments = [state["exp_avg"].clone() for state in tenant.optimizer.state.values()]
    step = tenant.optimizer.step

    def overflowing(*args, **kwargs):  # what an update that overflows leaves behind
        step(*args, **kwargs)
        with torch.no_grad():
            tenant.params[0].view(-1)[:3] = torch.tensor([float("inf"), float("nan"), float("-inf")])
    monkeypatch.setattr(tenant.optimizer, "step", overflowing)
    with pytest.raises(CallError, match="made 3 adapter values non-finite") as error:
        training.optim_step({"learning_rate": 1e-2}).result()
    assert error.value.field == "adam_params" and tenant.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params, tenant.params))
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, tenant.params))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, tenant.optimizer.state.values()))
    monkeypatch.undo()
    assert training.optim_step({"learning_rate": 1e-2}).result()["metrics"]["step:max"] == 2.0  # the kept gradients apply
    poisoned = {name: torch.full_like(value, float("nan")) for name, value in local.service.base.adapter_state(
        tenant.adapter).items()}
    with pytest.raises(CallError, match="non-finite values"):
        local.service.base.load_adapter_state(tenant.adapter, poisoned, "path")
    assert all(bool(torch.isfinite(param).all()) for param in tenant.params)


def test_a_reused_sampler_id_frees_the_adapter_it_replaces(local):
    """Issue 34 item 5: 300 saves under one sampling_session_seq_id left 153 adapters on the shared
    model while the quota counted 2."""
    service = local.service
    training = local.create_lora_training_client("tiny", rank=4).result()
    adapters, held = len(service.base.module.peft_config), len(service.samplers)
    for _ in range(5):
        service.save_for_sampler(local.owner, training.model_id, "reused:sample:0")
    assert len(service.base.module.peft_config) == adapters + 1 and len(service.samplers) == held + 1
    assert service.tenants[training.model_id].snapshots == ["reused:sample:0"]
    assert service.samplers["reused:sample:0"].adapter in service.base.module.peft_config


def test_train_unembed_adapts_the_lm_head_and_the_fused_head_applies_it(local):
    """Issue 34 item 9: Tinker's default `train_unembed=True` adapted nothing here. Now the LM head
    gets a LoRA adapter too, and the service's log-probs (the fused, chunked head) equal the peft
    model's own forward, which applies the head's adapter, after a step has trained it."""
    service = local.service
    default = local.create_lora_training_client("tiny", rank=4, seed=3).result()
    plain = local.create_lora_training_client("tiny", rank=4, seed=3, train_unembed=False).result()
    head = {mid: [n for n in service.base.adapter_state(service.tenants[mid].adapter) if ".lm_head." in n]
            for mid in (default.model_id, plain.model_id)}
    assert len(head[default.model_id]) == 2 and head[plain.model_id] == []  # lora_A and lora_B of lm_head
    data = [sequence_datum(local, "12+7=19"), sequence_datum(local, "3+4=7")]
    for _ in range(2):
        default.forward_backward(data, "cross_entropy").result()
        default.optim_step({"learning_rate": 5e-2}).result()
    tenant = service.tenants[default.model_id]
    lora_b = service.base.adapter_state(tenant.adapter)[next(n for n in head[default.model_id] if "lora_B" in n)]
    assert float(lora_b.abs().max()) > 1e-3  # B starts at 0: the head's adapter was trained
    output = default.forward(data, "cross_entropy").result()
    with torch.no_grad(), service.base.active(tenant.adapter):
        for datum, out in zip(data, output.loss_fn_outputs):
            logits = service.base.module(input_ids=torch.tensor([list(datum.tokens)])).logits[0]  # [L, V]
            expected = logits.log_softmax(-1).gather(1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])
            # two fp32 paths over 64-wide rows (chunked head vs. the module's matmul): ~1e-6 apart
            assert torch.allclose(out["logprobs"], expected[:, 0], atol=1e-4)


def test_a_state_saved_before_the_unembedding_was_adapted_still_loads(local):
    """Such a state's `lora` says train_unembed=True (the recorded default) but holds no lm_head
    tensors: it makes a client without the head's adapter, with the saved weights."""
    service = local.service
    training = local.create_lora_training_client("tiny", rank=4, seed=4, train_unembed=False).result()
    path = training.save_state("before-unembed").result().path
    file = service.store.check(local.owner, path)
    payload = torch.load(file, weights_only=True)
    payload["lora"]["train_unembed"] = True  # what the server recorded for Tinker's default before
    torch.save(payload, file)
    restored = local.create_training_client_from_state(path).result()
    tenant = service.tenants[restored.model_id]
    assert not tenant.lora.train_unembed
    saved = service.base.adapter_state(service.tenants[training.model_id].adapter)
    assert all(torch.equal(value, service.base.adapter_state(tenant.adapter)[name]) for name, value in saved.items())


def test_a_key_may_hold_max_saved_states_on_disk(tmp_path):
    import attrs

    from rlgraph.service.core import Service

    service = Service("tiny", state_dir=tmp_path)
    service.limits = attrs.evolve(service.limits, max_saved_states=2)
    client = LocalServiceClient(service=service, state_dir=tmp_path)
    try:
        training = client.create_lora_training_client("tiny", rank=2).result()
        for name in ("a", "b"):
            training.save_state(name).result()
        with pytest.raises(CallError, match="holds 2 saved states") as error:
            training.save_state("c").result()
        assert error.value.field == "path"
        training.save_state("a", overwrite=True).result()  # replacing one of its own is no new file
        other = LocalServiceClient(service=service, scheduler=client.scheduler, state_dir=tmp_path, owner="other")
        other.create_lora_training_client("tiny", rank=2).result().save_state("a").result()  # per key
    finally:
        client.scheduler.close()
