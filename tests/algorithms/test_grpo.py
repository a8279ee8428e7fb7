"""GRPO's `estimator` and `loss` hyper-parameters: any registered name, the op itself in the program."""

import pytest

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms import grpo
from rlgraph.functional.registry import UnknownNameError
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
    assert "stats{loss,grad_norm,clip_frac,approx_kl,entropy,kl}" in policy_loss
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
