"""Estimators and policy losses by name: one calling convention, the ops themselves underneath."""

import pytest
import torch

from rlgraph import functional as F
from rlgraph.functional.registry import UnknownNameError
from rlgraph.errors import TraceError
from tests.functional._batches import random_batch

BUILT_IN_ESTIMATORS = {  # name -> the direct call it stands for
    "group_normalize": lambda r, g, mask: F.group_normalize(r, g),
    "dr_grpo": lambda r, g, mask: F.group_normalize(r, g, scale=False),
    "rloo": lambda r, g, mask: F.rloo(r, g),
    "gpg": lambda r, g, mask: F.gpg(r, g),
    "reinforce_pp_baseline": lambda r, g, mask: F.reinforce_pp_baseline(r, g, mask),
    "opo": lambda r, g, mask: F.opo(r, g, mask),
}
BUILT_IN_LOSSES = {"ppo_clip", "gspo", "cispo", "gpg_loss", "clip_cov", "kl_cov", "policy_loss"}


def rollouts(b=3, n=4, t=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (b * n,), generator=gen).to(torch.float32)  # [N], ties included
    mask = torch.rand(b * n, t, generator=gen) > 0.3                          # [N, T]
    return rewards, torch.arange(b).repeat_interleave(n), mask


def test_the_built_ins_are_registered():
    assert set(BUILT_IN_ESTIMATORS) <= set(F.ESTIMATORS)
    assert BUILT_IN_LOSSES <= set(F.LOSSES)                                 # other tests register more
    assert all(F.ESTIMATORS[name].doc for name in BUILT_IN_ESTIMATORS) and all(entry.doc for entry in F.LOSSES.values())


@pytest.mark.parametrize("name", sorted(BUILT_IN_ESTIMATORS))
def test_every_estimator_is_called_one_way_and_equals_its_op(name):
    rewards, group, mask = rollouts()
    by_name = F.get_estimator(name)(rewards, group, n=4, mask=mask)          # [N]
    torch.testing.assert_close(by_name, BUILT_IN_ESTIMATORS[name](rewards, group, mask))


def test_hyper_parameters_pass_through_and_fixed_ones_stay():
    rewards, group, mask = rollouts()
    torch.testing.assert_close(F.get_estimator("gpg")(rewards, group, n=4, mask=None, f_norm=2.0),
                               F.gpg(rewards, group, f_norm=2.0))
    assert F.get_estimator("dr_grpo").hparams == {"scale": False} and F.get_estimator("dr_grpo").op is F.group_normalize


def test_a_per_row_argument_other_than_the_mask_cannot_be_called_by_name():
    @F.estimator(name="registry_with_lengths")
    def with_lengths(r, lengths):                                              # usable directly, not by name
        return r - lengths

    rewards, group, mask = rollouts()
    with pytest.raises(TraceError, match="(?s)per-row argument .lengths.*fix: take the mask as `mask`"):
        F.get_estimator("registry_with_lengths")(rewards, group, n=4, mask=mask)


def test_an_estimator_that_reads_lengths_asks_for_the_mask():
    rewards, group, _ = rollouts()
    with pytest.raises(ValueError, match="opo.*pass mask=bool"):
        F.get_estimator("opo")(rewards, group, n=4)
    assert F.get_estimator("rloo")(rewards, group, n=4).shape == rewards.shape   # no mask needed


@pytest.mark.parametrize("name", sorted(BUILT_IN_LOSSES))
def test_every_loss_is_called_one_way_and_returns_its_named_metrics(name):
    b = random_batch(0, 6, 5, dtype=torch.float32)
    entry = F.get_loss(name)
    out = entry(b["lp"], b["old_lp"], b["adv"], b["mask"])
    direct = getattr(F, name)(b["lp"], b["old_lp"], b["adv"], b["mask"])
    assert len(out) == 1 + len(entry.metrics) and entry.metrics[:2] == ("clip_frac", "approx_kl")
    for got, want in zip(out, direct):
        torch.testing.assert_close(got, want)


def test_supported_keeps_the_hyper_parameters_a_loss_takes():
    clipping = {"clip_low": 0.1, "clip_high": 0.3}
    assert F.get_loss("ppo_clip").supported(**clipping) == clipping
    assert F.get_loss("gspo").supported(**clipping) == clipping
    assert F.get_loss("gpg_loss").supported(**clipping) == {} and F.get_loss("kl_cov").supported(**clipping) == {}


def test_unknown_names_say_what_is_registered_and_what_is_close():
    with pytest.raises(UnknownNameError) as estimator_error:
        F.get_estimator("rlo")
    text = str(estimator_error.value)
    assert "estimator='rlo' is not a registered estimator; did you mean 'rloo'?" in text
    assert "group_normalize" in text and "opo" in text and "@F.estimator" in text and "test_registry.py" in text
    with pytest.raises(KeyError, match="loss='gsop' is not a registered loss; did you mean 'gspo'"):
        F.get_loss("gsop")                                                     # a KeyError too, as dict lookups
    with pytest.raises(UnknownNameError, match="ppo_clip"):
        F.get_loss(None)


def test_a_name_cannot_be_taken_twice_but_the_same_definition_can_register_again():
    F.register_loss("registry_probe", F.ppo_clip)
    F.register_loss("registry_probe", F.ppo_clip)                              # same definition: fine
    with pytest.raises(ValueError, match="already registered"):
        F.register_loss("registry_probe", F.gspo)
    with pytest.raises(ValueError, match="already registered"):
        F.register_estimator("rloo", F.gpg)


def test_a_user_loss_registers_with_its_own_metrics():
    def hinge(lp, old_lp, adv, mask, *, margin=1.0):
        """Hinge: L = token_mean(relu(margin - A lp))."""
        per_token = torch.relu(margin - adv * lp)                              # [N, T]
        return F.token_mean(per_token, mask), F.token_mean((per_token > 0).to(lp.dtype), mask)

    entry = F.register_loss("registry_hinge", hinge, metrics=("active",))
    b = random_batch(1, 4, 3, dtype=torch.float32)
    loss, active = F.get_loss("registry_hinge")(b["lp"], b["old_lp"], b["adv"], b["mask"], margin=0.5)
    assert entry.metrics == ("active",) and entry.doc.startswith("Hinge") and 0.0 <= float(active) <= 1.0
