"""LoRA via peft (`rlgraph.backends.lora`) and how the local executor trains and checkpoints it.

Tiny Qwen2 (h=64, 4 heads, 2 kv heads of 16, 2 layers), CPU, fp32. Tolerances: log-probs of the
merged model vs the peft model within 1e-5 (the merge reassociates W x + B (A x) s as (W + s B A) x);
the reference view vs the base model exactly (the same modules, the adapter branch skipped).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlgraph.backends.local.state import CheckpointMismatch, LMWorker, checkpoint_weights, describe_weights
from rlgraph.backends.local.executor import LocalExecutor, RewardWorker
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.backends.protocols import LossCounts, ModelRef, UpdateConfig
from rlgraph.errors import ConfigError
from rlgraph.testing import tiny_prompts
from rlgraph.testing.tiny import length_parity_reward
from rlgraph.train.checkpoint import load_checkpoint, save_checkpoint
from rlgraph.backends.lora import (LoraSettings, apply_lora, is_lora, merged_state_dict, reference_of,
                                trainable_state)

POLICY, REF = ModelRef("policy", 0), ModelRef("ref", 0)
TOKENIZER = load_tokenizer()


def _base(seed: int = 0):
    return build_causal_lm(tokenizer=TOKENIZER, seed=seed)


def _lora_executor(r: int = 4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), *, lr: float = 1e-2,
                   seed: int = 0) -> LocalExecutor:
    """A LoRA policy (AdamW over the parameters that require grad, as `rlgraph train` builds it)
    and its reference view."""
    policy = apply_lora(_base(seed), LoraSettings(r=r, target_modules=targets))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    models = {"policy": LMWorker(policy, optimizer), "ref": LMWorker(reference_of(policy))}
    return LocalExecutor(models, {"reward": RewardWorker(length_parity_reward)}, TOKENIZER, max_new_tokens=4, seed=seed)


def _loss(batch):
    def loss_fn(rows: torch.Tensor, counts: LossCounts, lp: torch.Tensor, entropy):
        return -(lp * batch.mask[rows]).sum() / counts.tokens, {}  # lp: [n, T]
    return loss_fn


def _train(executor: LocalExecutor, steps: int = 3):
    """`steps` updates of the policy on its own rollouts (two mini-batches each)."""
    ro = executor.generate(executor.current("policy"), tiny_prompts(4), n=2)
    for _ in range(steps):
        executor.update(executor.current("policy"), ro, _loss(ro), UpdateConfig(minibatches=2))
    return ro


def _adapter_count(r: int, layers: int = 2, hidden: int = 64, q_dim: int = 64, kv_dim: int = 32) -> int:
    """r * (in + out) per wrapped linear: q [64->64], k, v [64->32], o [64->64], per layer."""
    return layers * r * ((hidden + q_dim) + 2 * (hidden + kv_dim) + (q_dim + hidden))


# -- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    ({"r": 0}, "r=0: the adapter rank must be a whole number >= 1"),
    ({"r": -3}, "r=-3"),
    ({"r": 2.5}, "r=2.5"),
    ({"r": True}, "r=True"),
    ({"alpha": -1}, "alpha=-1: the scale numerator must be a finite number > 0"),
    ({"alpha": 0.0}, "alpha=0.0"),
    ({"alpha": math.nan}, "alpha=nan"),
    ({"dropout": 1.0}, "dropout=1.0: a probability in [0, 1) is needed"),
    ({"dropout": -0.1}, "dropout=-0.1"),
    ({"target_modules": ()}, "target_modules=(): a non-empty list of linear module names"),
    ({"target_modules": ("q_proj", "")}, "target_modules=('q_proj', '')"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(ConfigError) as error:
        LoraSettings(**kwargs)
    assert words in str(error.value) and "fix:" in str(error.value)


def test_settings_take_a_single_name_or_a_list_and_give_the_scale():
    assert LoraSettings(target_modules="q_proj").target_modules == ("q_proj",)
    assert LoraSettings(target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj", "v_proj")
    assert LoraSettings(r=16, alpha=32).scale == 2.0


@pytest.mark.parametrize("target, words", [
    ("qproj", "'qproj' matches no linear module of Qwen2ForCausalLM; did you mean 'q_proj'?"),
    ("attn", "'attn' matches no linear module"),
    ("embed_tokens", "'embed_tokens' matches no linear module"),  # an embedding, not a linear
])
def test_a_target_that_matches_no_linear_module_is_refused_listing_the_models(target, words):
    model = _base()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as error:
        apply_lora(model, LoraSettings(target_modules=("q_proj", target)))
    message = str(error.value)
    assert words in message
    assert "its linear modules: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in message
    assert not is_lora(model) and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lora_is_applied_once():
    with pytest.raises(ConfigError, match="already holds LoRA adapters"):
        apply_lora(apply_lora(_base(), LoraSettings()), LoraSettings())


# -- the model -------------------------------------------------------------------------------------
def test_only_the_adapters_train_and_a_fresh_adapter_changes_nothing():
    base = _base()
    model = apply_lora(_base(), LoraSettings(r=4))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert sum(p.numel() for p in trainable.values()) == _adapter_count(4) == 2 * 4 * 448
    assert set(trainable_state(model)) == set(trainable) and is_lora(model) and not is_lora(base)
    ro = NativeGenerator(base, eos_token_id=TOKENIZER.eos_token_id, pad_token_id=TOKENIZER.pad_token_id).generate(
        tiny_prompts(2), 2, SamplingParams(max_new_tokens=4), seed=1)
    torch.testing.assert_close(sequence_logprobs(model.eval(), ro), sequence_logprobs(base.eval(), ro), atol=0, rtol=0)


def test_fresh_adapters_depend_on_the_seed_only_and_leave_the_global_rng_alone():
    torch.manual_seed(1)
    first = trainable_state(apply_lora(_base(), LoraSettings()))
    state = torch.get_rng_state()
    torch.manual_seed(2)
    again = trainable_state(apply_lora(_base(), LoraSettings()))
    other = trainable_state(apply_lora(_base(), LoraSettings(), seed=1))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first if ".lora_A." in name)
    torch.manual_seed(1)
    apply_lora(_base(), LoraSettings())
    assert torch.equal(torch.get_rng_state(), state)


def test_updates_change_only_the_adapters_and_the_optimizer_holds_only_them():
    executor = _lora_executor()
    model = executor.models["policy"].model
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    _train(executor)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in frozen.items())  # bit-identical base
    changed = [name for name, value in adapters.items() if not torch.equal(after[name], value)]
    assert len(changed) == len(adapters)  # every A and B moved (B from 0, then A through B)
    optimizer = executor.models["policy"].optimizer
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(after[name]) for name in adapters} and {id(p) for p in optimizer.state} == held
    assert executor.current("policy") == ModelRef("policy", 3)


def test_the_reference_view_has_no_weights_and_gives_the_base_models_logprobs_and_tokens():
    base = _base()  # the model before LoRA
    executor = _lora_executor()
    ro = _train(executor)
    reference = executor.models["ref"].model
    assert list(reference.parameters()) == [] and len(reference.state_dict()) == 0
    policy_lp, ref_lp = executor.logprobs(POLICY.__class__("policy", 3), ro), executor.logprobs(REF, ro)
    torch.testing.assert_close(ref_lp, sequence_logprobs(base.eval(), ro), atol=0, rtol=0)
    assert (policy_lp - ref_lp).abs().max() > 1e-3  # the trained adapters are on again for the policy
    policy = executor.models["policy"].model
    assert policy.training and all(p.requires_grad for name, p in policy.named_parameters() if ".lora_" in name)
    params = SamplingParams(max_new_tokens=6)
    sample = lambda model: NativeGenerator(model, eos_token_id=TOKENIZER.eos_token_id,  # noqa: E731
                                           pad_token_id=TOKENIZER.pad_token_id).generate(tiny_prompts(3), 2, params, seed=5)
    from_ref, from_base = sample(reference), sample(base)
    assert torch.equal(from_ref.response_ids, from_base.response_ids)
    torch.testing.assert_close(from_ref.logprobs, from_base.logprobs, atol=1e-6, rtol=0)


def test_merged_weights_in_a_plain_model_give_the_peft_models_logprobs_and_leave_it_unmerged():
    executor = _lora_executor()
    ro = _train(executor)
    model = executor.models["policy"].model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    plain = _base(seed=7)  # other weights: everything must come from `merged`
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(sequence_logprobs(plain.eval(), ro), sequence_logprobs(model, ro), atol=1e-5, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    params = SamplingParams(max_new_tokens=6)
    peft_rows, plain_rows = (NativeGenerator(m, eos_token_id=TOKENIZER.eos_token_id, pad_token_id=TOKENIZER.pad_token_id)
                             .generate(tiny_prompts(3), 2, params, seed=3) for m in (model, plain))
    assert torch.equal(peft_rows.response_ids, plain_rows.response_ids)  # a generator served merged weights samples alike
    torch.testing.assert_close(peft_rows.logprobs, plain_rows.logprobs, atol=1e-5, rtol=0)
    q = "model.layers.0.self_attn.q_proj.weight"
    peft_q = model.get_base_model().model.layers[0].self_attn.q_proj
    delta = peft_q.lora_B["default"].weight @ peft_q.lora_A["default"].weight * (16.0 / 4)  # [64, 4] @ [4, 64]
    torch.testing.assert_close(merged[q], peft_q.base_layer.weight + delta, atol=1e-7, rtol=0)


def test_reference_and_merge_refuse_a_plain_model():
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM is not a LoRA model"):
        reference_of(_base())
    with pytest.raises(ConfigError, match="merged_state_dict: Qwen2ForCausalLM is not a LoRA model"):
        merged_state_dict(_base())


# -- checkpoints -----------------------------------------------------------------------------------
def test_a_lora_role_checkpoints_only_its_adapters_and_the_reference_nothing():
    executor = _lora_executor()
    _train(executor, steps=1)
    state = executor.export_state()
    policy = state.roles["policy"]
    assert set(policy.model) == set(trainable_state(executor.models["policy"].model)) and len(policy.model) == 16
    assert state.roles["ref"].model == {} and state.roles["ref"].optimizer is None
    assert len(policy.optimizer["state"]) == 16  # AdamW moments of the adapters only
    assert describe_weights(policy.model) == "LoRA adapters r=4 on k_proj,o_proj,q_proj,v_proj"


def test_export_and_import_round_trip_through_a_checkpoint_directory(tmp_path):
    trained = _lora_executor()
    ro = _train(trained)
    path = save_checkpoint(tmp_path, 3, trained, {"note": 1})
    fresh = _lora_executor()  # the base from the same source; new (zero-B) adapters
    assert load_checkpoint(path, fresh)["note"] == 1
    assert fresh.current("policy") == ModelRef("policy", 3)
    for role in ("policy", "ref"):
        ref = fresh.current(role)
        torch.testing.assert_close(fresh.logprobs(ref, ro), trained.logprobs(trained.current(role), ro), atol=0, rtol=0)
    _train(trained, steps=1), _train(fresh, steps=1)  # the optimizer state came back too: the next step agrees
    for (name, a), b in zip(trained.models["policy"].model.named_parameters(), fresh.models["policy"].model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("theirs, ours, words", [
    ({"r": 8}, {"r": 16}, "holds LoRA adapters r=8 on k_proj,o_proj,q_proj,v_proj; this run has LoRA adapters r=16 on "
                          "k_proj,o_proj,q_proj,v_proj"),
    ({"targets": ("q_proj", "v_proj")}, {}, "holds LoRA adapters r=4 on q_proj,v_proj; this run has LoRA adapters r=4 "
                                            "on k_proj,o_proj,q_proj,v_proj"),
    ({"targets": ("q_proj", "gate_proj")}, {"targets": ("q_proj", "up_proj")},
     "holds LoRA adapters r=4 on gate_proj,q_proj; this run has LoRA adapters r=4 on q_proj,up_proj"),
])
def test_a_checkpoint_with_other_adapters_is_refused_saying_what_differs(theirs, ours, words):
    source, target = _lora_executor(**theirs), _lora_executor(**ours)
    state = source.export_state()
    before = {k: v.clone() for k, v in target.models["policy"].model.state_dict().items()}
    with pytest.raises(CheckpointMismatch) as error:
        target.import_state(state, where="checkpoint step-3")
    assert f"checkpoint step-3: role 'policy' {words}" in str(error.value) and "fix:" in str(error.value)
    assert all(torch.equal(before[k], v) for k, v in target.models["policy"].model.state_dict().items())


def test_full_weights_and_adapters_do_not_load_into_each_other():
    from rlgraph.testing import tiny_executor

    full = tiny_executor(("policy",), optimizer="adamw")
    lora = _lora_executor()
    lora.models.pop("ref")
    with pytest.raises(CheckpointMismatch, match=r"holds full weights \(\d+ tensors\); this run has LoRA adapters r=4"):
        lora.import_state(full.export_state())
    with pytest.raises(CheckpointMismatch, match=r"holds LoRA adapters r=4 on k_proj,o_proj,q_proj,v_proj; this run "
                                                 r"has full weights"):
        full.import_state(lora.export_state())


def test_a_frozen_full_copy_still_checkpoints_every_tensor():
    worker = LMWorker(copy.deepcopy(_base()).requires_grad_(False))
    assert set(checkpoint_weights(worker)) == set(worker.model.state_dict())
    assert describe_weights({}) == "no weights (a view of another role's weights)"


# -- end to end ------------------------------------------------------------------------------------
def _grpo_trainer(run_dir):
    """GRPO with a KL term (so the reference view runs) through the compiled plan, checkpointing every 2 steps."""
    import rlgraph as rg
    from rlgraph.algorithms import grpo
    from rlgraph.data import arithmetic
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.train.loop import Trainer

    executor = _lora_executor(lr=3e-2)
    compiled = rg.compile(grpo, mesh=rg.Mesh("cpu", 1, 1), placement=rg.colocated(offload=False), engine="native",
                          sizes={"B": 3, "P": 8, "T": 3}, lora={"policy": {"r": 4}}, n=2, kl=0.1, max_new_tokens=3)
    sampler = arithmetic.PromptSampler(arithmetic.make_splits(seed=0).train, batch_size=3, seed=1)
    trainer = Trainer(PlanRunner(compiled, executor),
                      lambda: arithmetic.to_prompts(sampler.next_batch(), TOKENIZER), sampler, run_dir=run_dir,
                      checkpoint_every=2)
    return trainer, executor


@pytest.mark.slow
def test_grpo_with_kl_on_a_lora_policy_trains_the_adapters_and_resumes_exactly(tmp_path):
    straight, straight_exec = _grpo_trainer(tmp_path / "a")
    list(straight.run(steps=4))
    assert "ref" in {group.name for group in straight.runner.compiled.plan.groups}  # the KL term reads the view
    model, base = straight_exec.models["policy"].model, _base()
    for name, tensor in merged_state_dict(model).items():  # the base never moved; the adapters did
        assert torch.equal(tensor, base.state_dict()[name]) != (name.endswith("_proj.weight") and "mlp" not in name), name
    first, _ = _grpo_trainer(tmp_path / "b")
    list(first.run(steps=3))  # checkpoint at step 2, then one step that is lost
    resumed, resumed_exec = _grpo_trainer(tmp_path / "b")
    assert resumed.resume() and resumed.step == 2
    list(resumed.run(steps=2))
    assert [m["reward"] for m in resumed.history] == [m["reward"] for m in straight.history]
    for (name, a), b in zip(straight_exec.models["policy"].model.named_parameters(),
                            resumed_exec.models["policy"].model.parameters()):
        assert torch.equal(a, b), name
