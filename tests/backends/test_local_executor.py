"""The local executor's device and precision, on the CPU. Its CUDA path is tested in tests/gpu.

The bf16 test runs the precision the executor uses on CUDA (autocast over fp32 weights) under CPU
autocast: the same code path, so its dtypes and its agreement with fp32 are checked without a GPU.
Tolerance: log-probs within 5e-2 of fp32 (bf16 keeps 8 significant bits; a 2-layer model's
log-probs of magnitude ~4 move by a few 1e-2).
"""

import pytest
import torch

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.generation import TokenizerError
from rlgraph.backends.protocols import LossCounts, ModelRef, UpdateConfig
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.batches import Rollouts
from rlgraph.testing import tiny_executor, tiny_prompts

POLICY = ModelRef("policy", 0)


def _mean_logprob_loss(batch: Rollouts):
    """loss_fn(rows, counts, lp [n, T], entropy) = -sum(lp * mask) / tokens of the mini-batch."""
    def loss_fn(rows: torch.Tensor, counts: LossCounts, lp: torch.Tensor, entropy: torch.Tensor | None):
        return -(lp * batch.mask[rows]).sum() / counts.tokens, {}
    return loss_fn


def test_an_executor_is_on_the_cpu_in_fp32_unless_told():
    executor = tiny_executor()
    assert executor.device == torch.device("cpu") and executor.compute_dtype is None
    ro = executor.generate(POLICY, tiny_prompts(2), n=2)
    assert ro.response_ids.device.type == "cpu" and executor.logprobs(POLICY, ro).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_cuda_executor_on_a_machine_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="'cuda' was asked for, but torch sees no CUDA GPU here; use 'cpu'"):
        WorldSpec({"policy": RoleSpec(optimizer="sgd")}).build_local("cuda")


def test_bf16_autocast_keeps_fp32_logprobs_weights_and_optimizer_state():
    fp32, bf16 = tiny_executor(optimizer="adamw"), tiny_executor(optimizer="adamw")
    bf16.compute_dtype = torch.bfloat16  # what a CUDA executor sets itself
    ro = fp32.generate(POLICY, tiny_prompts(4), n=2)
    sampled = bf16.generate(POLICY, tiny_prompts(4), n=2)
    assert sampled.logprobs.dtype == torch.float32
    exact, rounded = fp32.logprobs(POLICY, ro), bf16.logprobs(POLICY, ro)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)  # it did compute in bf16
    torch.testing.assert_close(rounded, exact, atol=5e-2, rtol=0)
    ref, stats = bf16.update(POLICY, ro, _mean_logprob_loss(ro), UpdateConfig())
    assert ref == ModelRef("policy", 1) and stats["grad_norm"] > 0
    worker = bf16.models["policy"]
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())  # the master weights
    assert all(v.dtype == torch.float32 for state in worker.optimizer.state.values() for k, v in state.items()
               if k != "step")


def test_a_checkpoint_holds_cpu_tensors():
    executor = tiny_executor(optimizer="adamw")
    ro = executor.generate(POLICY, tiny_prompts(2), n=2)
    executor.update(POLICY, ro, _mean_logprob_loss(ro), UpdateConfig())
    state = executor.export_state().roles["policy"]
    tensors = [*state.model.values(), *(v for entry in state.optimizer["state"].values() for v in entry.values())]
    assert tensors and all(t.device.type == "cpu" for t in tensors)


# -- non-finite values never reach the weights ------------------------------------------------------


def _nan_loss(micro_rows, counts, output, entropy):
    return output.sum() * float("nan"), {}


def _weights(executor):
    return {k: v.clone() for k, v in executor.models["policy"].model.state_dict().items()}


def test_a_nan_gradient_stops_the_update_before_any_weight_changes():
    from rlgraph.backends.local.training import NonFiniteUpdate
    from rlgraph.backends.protocols import ModelRef, UpdateConfig
    from rlgraph.testing import tiny_executor, tiny_prompts

    executor = tiny_executor()
    rollouts = executor.generate(ModelRef("policy", 0), tiny_prompts(2), n=2)
    before = _weights(executor)
    with pytest.raises(NonFiniteUpdate, match=r"policy@0: the gradient norm is nan at epoch 0, mini-batch 0.*rows with a non-finite loss here: \[0, 1, 2, 3\]"):
        executor.update(ModelRef("policy", 0), rollouts, _nan_loss, UpdateConfig())
    assert all(torch.equal(before[k], v) for k, v in _weights(executor).items())
    assert executor.current("policy").version == 0


def test_on_nonfinite_skip_drops_the_step_and_counts_it():
    from rlgraph.backends.protocols import ModelRef, UpdateConfig
    from rlgraph.testing import tiny_executor, tiny_prompts

    executor = tiny_executor()
    rollouts = executor.generate(ModelRef("policy", 0), tiny_prompts(2), n=2)
    before = _weights(executor)
    ref, stats = executor.update(ModelRef("policy", 0), rollouts, _nan_loss, UpdateConfig(on_nonfinite="skip"))
    assert stats["skipped_steps"] == 1.0 and ref.version == 1
    assert all(torch.equal(before[k], v) for k, v in _weights(executor).items())
    with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'skip'"):
        UpdateConfig(on_nonfinite="ignore")


@pytest.mark.parametrize("reward, message", [
    (lambda c, **_: [float("nan")] + [1.0] * (len(c) - 1), r"non-finite rewards for 1 sample\(s\) \(sample 0: nan for "),
    (lambda c, **_: [float("inf")] * len(c), r"non-finite rewards for 4 sample"),
    (lambda c, **_: ["good"] * len(c), r"not a list of numbers; sample 0 got 'good'"),
    (lambda c, **_: [None] * len(c), r"not a list of numbers; sample 0 got None"),
    (lambda c, **_: [1.0], r"returned shape \(1,\); expected one number per completion \(4,\)"),
])
def test_a_reward_that_is_not_one_finite_number_per_completion_names_the_sample(reward, message):
    from rlgraph.errors import RewardError
    from rlgraph.backends.protocols import ModelRef, RewardRef
    from rlgraph.testing import tiny_executor, tiny_prompts

    executor = tiny_executor(reward=reward)
    rollouts = executor.generate(ModelRef("policy", 0), tiny_prompts(2), n=2)
    with pytest.raises(RewardError, match=message):
        executor.score(RewardRef("reward"), rollouts)


def test_update_refuses_an_unknown_nonfinite_policy_at_the_users_line():
    import rlgraph as rg
    from rlgraph.errors import TraceError

    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        policy = rg.update(state.policy, ro, lambda lp: (lp * ro.mask).sum(), on_nonfinite="ignore")
        return state.replace(policy=policy), {}

    with pytest.raises(TraceError, match="on_nonfinite='ignore'") as caught:
        bad.trace()
    assert "test_local_executor.py" in str(caught.value)


class _NoEos:
    eos_token_id = None
    pad_token_id = 0


class _NoPad:
    eos_token_id = 2
    pad_token_id = None


@pytest.mark.parametrize("tok, name", [(_NoEos(), "eos_token_id is None"), (_NoPad(), "pad_token_id is None"),
                                       (object(), "eos_token_id is None")])
def test_a_tokenizer_without_eos_or_pad_is_refused_when_the_executor_is_built(tok, name):
    with pytest.raises(TokenizerError, match=name + r"; generation needs one\n  fix: tokenizer"):
        LocalExecutor({}, {}, tok)


@pytest.mark.parametrize("eos", [None, -1, True, "2"])
def test_the_generator_refuses_an_eos_that_is_no_token_id(eos):
    from rlgraph.backends.local.generation import NativeGenerator

    with pytest.raises(TokenizerError, match=f"NativeGenerator: eos_token_id is {eos!r}; generation needs one"):
        NativeGenerator(torch.nn.Linear(1, 1), eos_token_id=eos, pad_token_id=0)


def test_a_nan_gradient_under_the_compiled_forward_changes_no_weight(monkeypatch):
    """`train.compile` (a counting `aot_eager` backend in place of Inductor: the same guards and
    control flow) keeps `on_nonfinite`: raise names the rows, skip counts the step, no weight moves."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from rlgraph.backends.local import train_compile
    from rlgraph.backends.local.training import NonFiniteUpdate
    from rlgraph.backends.local.logprobs import role_outputs

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(train_compile, "compiled_role_outputs", lambda *_: torch.compile(role_outputs, backend=counter))
    torch._dynamo.reset()
    try:
        executor = tiny_executor()
        executor.compile_train = True
        rollouts = executor.generate(POLICY, tiny_prompts(2), n=2)
        before = _weights(executor)
        with pytest.raises(NonFiniteUpdate, match=r"rows with a non-finite loss here: \[0, 1, 2, 3\]"):
            executor.update(POLICY, rollouts, _nan_loss, UpdateConfig())
        _, stats = executor.update(POLICY, rollouts, _nan_loss, UpdateConfig(on_nonfinite="skip"))
        assert stats["skipped_steps"] == 1.0 and counter.frame_count >= 1
        assert all(torch.equal(before[k], v) for k, v in _weights(executor).items())
    finally:
        torch._dynamo.reset()


def test_set_mode_walks_the_modules_only_when_one_is_in_the_other_mode(monkeypatch):
    from rlgraph.backends.local.training import set_mode

    model = tiny_executor().models["policy"].model.train()
    walks = []
    monkeypatch.setattr(type(model), "train", lambda self, mode=True: walks.append(mode) or torch.nn.Module.train(self, mode))
    set_mode(model, training=True)
    assert walks == []
    next(iter(model.modules())).training = True
    list(model.modules())[-1].training = False  # one leaf in eval: the walk puts it back
    set_mode(model, training=True)
    assert walks == [True] and all(m.training for m in model.modules())
    set_mode(model, training=False)
    set_mode(model, training=False)
    assert walks == [True, False] and not any(m.training for m in model.modules())


def test_a_frozen_reference_stays_in_eval_mode_and_a_trainable_role_gets_its_mode_back():
    """`_inference` leaves a frozen role that shares no module with a trainable one in eval mode
    (no walk back each call); the policy returns to the mode it had, and its update trains."""
    executor = tiny_executor(("policy", "ref"))
    policy, ref = executor.models["policy"].model.train(), executor.models["ref"].model.train()
    rollouts = executor.generate(POLICY, tiny_prompts(2), n=2)
    first = executor.logprobs(executor.current("ref"), rollouts)
    assert not any(m.training for m in ref.modules())
    torch.testing.assert_close(executor.logprobs(executor.current("ref"), rollouts), first, rtol=0, atol=0)
    executor.logprobs(POLICY, rollouts)
    assert all(m.training for m in policy.modules())
    seen = []
    handle = policy.model.register_forward_pre_hook(lambda module, args: seen.append(module.training))  # the decoder
    try:
        executor.update(POLICY, rollouts, _mean_logprob_loss(rollouts), UpdateConfig())
    finally:
        handle.remove()
    assert seen == [True] and not ref.training
