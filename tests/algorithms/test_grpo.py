"""GRPO's `estimator` and `loss` hyper-parameters: any registered name, the op itself in the program."""

import math

import attrs
import pytest
import torch

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph import functional as F
from rlgraph.algorithms import grpo
from rlgraph.functional.registry import UnknownNameError
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps

KERNELS = {"group_normalize": "fused_group_normalize", "dr_grpo": "fused_group_normalize", "rloo": "fused_rloo",
           "reinforce_pp_baseline": "fused_reinforce_pp_baseline"}  # the rest run their torch op


@F.estimator
def grpo_test_length_baseline(r, mask):                # r: f32[n], mask: bool[n, T], one group
    length = mask.sum(-1).to(r.dtype)                  # [n]
    return r - r.mean() - 0.01 * (length - length.mean())


@pytest.mark.parametrize("name", sorted(set(KERNELS) | {"gpg", "opo", "grpo_test_length_baseline"}))
def test_every_registered_estimator_traces_inside_grpo_and_compiles(name):
    entry = F.get_estimator(name)
    text = str(grpo.trace(estimator=name))
    assert f"= {entry.op.__name__}" in text and "ppo_clip[clip_low=0.2 clip_high=0.2]" in text
    plan = rg.compile(grpo, mesh="gpu:8", estimator=name).as_text()
    assert f"{entry.op.__name__}={entry.op.__name__}" in plan and (KERNELS[name] in plan if name in KERNELS else True)


def test_every_built_in_estimator_is_covered_above():
    built_in = {name for name, entry in F.ESTIMATORS.items() if entry.op.__module__ == "rlgraph.functional.advantages"}
    assert built_in == set(KERNELS) | {"gpg", "opo"}


def test_dr_grpo_by_name_is_group_normalize_without_scaling():
    assert "= group_normalize[scale=False] b c" in str(grpo.trace(estimator="dr_grpo"))


def test_the_mask_is_read_only_by_estimators_that_take_it():
    assert "= opo b d c" in str(grpo.trace(estimator="opo"))             # c = a.mask, read before the estimator
    assert "= grpo_test_length_baseline[n=8] b d c" in str(grpo.trace(estimator="grpo_test_length_baseline"))


def test_the_loss_hyper_parameter_changes_the_printed_loss():
    text = str(grpo.trace(loss="gspo"))
    assert "= gspo[clip_low=0.2 clip_high=0.2] lp f e g" in text and "ppo_clip" not in text
    assert "= gpg_loss lp f e g" in str(grpo.trace(loss="gpg_loss"))     # takes no clip range: none passed
    assert "gspo[clip_low=0.0003 clip_high=0.0004]" in str(grpo.trace(loss="gspo", clip=3e-4, clip_high=4e-4))
    policy_loss = str(grpo.trace(loss="policy_loss"))
    assert "stats{loss,grad_norm,clip_frac,approx_kl,entropy,kl,logprob_diff}" in policy_loss
    assert "kernels: fused_policy_loss (in loss)" in rg.compile(grpo, mesh="gpu:8", loss="policy_loss").as_text()


def test_a_user_estimator_and_another_loss_train_for_two_steps():
    text, metrics = two_steps(grpo, n=4, max_new_tokens=4, estimator="grpo_test_length_baseline", loss="cispo")
    assert "grpo_test_length_baseline[n=4]" in text and "= cispo[" in text
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0


@pytest.mark.parametrize("hparams, message", [
    ({"estimator": "rlo"}, "estimator='rlo' is not a registered estimator; did you mean 'rloo'?"),
    ({"loss": "ppo_clipp"}, "loss='ppo_clipp' is not a registered loss; did you mean 'ppo_clip'?"),
])
def test_unknown_names_fail_while_tracing_at_the_line_of_grpo(hparams, message):
    with pytest.raises(UnknownNameError) as error:
        grpo.trace(**hparams)
    assert message in str(error.value) and "grpo.py" in str(error.value) and "rlgraph list" in str(error.value)


# -- rollout correction (tis_cap) ------------------------------------------------------------------

SIZES = {"B": 2, "P": 8, "T": 3}


def test_tis_cap_traces_compiles_and_a_compiled_step_matches_eager():
    text = str(grpo.trace(tis_cap=2.0))
    assert "= logprobs[temperature=1.0 entropy=False] policy a" in text
    assert "truncated_is_weights[cap=2.0]" in text
    compiled = rg.compile(grpo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False), sizes=SIZES,
                          n=2, max_new_tokens=3, tis_cap=2.0)
    assert "masked_max=masked_max" in compiled.as_text() and "kernels: fused_ppo_clip (in loss)" in compiled.as_text()
    steps = rgt.assert_compiled_matches_eager(grpo, executor=rgt.tiny_executor, sizes=SIZES, n=2, max_new_tokens=3,
                                              tis_cap=2.0, batches=[rgt.tiny_prompts(2, offset=2 * i) for i in range(2)])
    for metrics in steps:
        mean, largest = metrics["logprob_mismatch/mean"], metrics["logprob_mismatch/max"]
        assert math.isfinite(mean) and math.isfinite(largest) and 0.0 <= mean <= largest
        assert largest < 1e-4  # the native fp32 engine and the trainer agree: no mismatch to correct


def _shifted_generator(shift: float):
    """A tiny executor whose sampler reports log-probs `shift` below the trainer's, as a bf16 engine might."""
    executor = rgt.tiny_executor(max_new_tokens=3)
    native = executor.generate

    def generate(*args, **kwargs):
        ro = native(*args, **kwargs)
        return attrs.evolve(ro, logprobs=torch.where(ro.mask, ro.logprobs - shift, 0.0))

    executor.generate = generate
    return executor


def test_the_correction_reports_and_reweights_a_known_mismatch():
    losses = {}
    for cap in (1.0, 2.0):  # cap 1 truncates exp(0.25) to 1: the loss without the weight
        program = grpo.trace(n=4, max_new_tokens=3, tis_cap=cap)
        _, metrics = Interpreter(_shifted_generator(0.25)).run(program, rgt.tiny_prompts(3))
        assert metrics["logprob_mismatch/mean"] == pytest.approx(0.25, abs=1e-5)
        assert metrics["logprob_mismatch/max"] == pytest.approx(0.25, abs=1e-5)
        losses[cap] = metrics["policy/loss"]
    assert losses[1.0] != 0.0 and losses[2.0] == pytest.approx(math.exp(0.25) * losses[1.0], rel=1e-4)
