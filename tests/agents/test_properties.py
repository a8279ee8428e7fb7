"""Properties of multi-turn batches (hypothesis): observation tokens are context, never targets."""

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph import functional as F
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.protocols import EnvRef
from rlgraph.batches import Rollouts
from rlgraph.testing import tiny_executor, tiny_prompts
from tests.helpers import RTOL


@st.composite
def trajectories(draw, max_rows=4, max_tokens=10):
    """Per-token values of a random multi-turn batch: which real tokens are the policy's (mask) and
    which the environment's (context_mask & ~mask), then padding; log-probs anywhere."""
    rows, steps = draw(st.integers(1, max_rows)), draw(st.integers(1, max_tokens))
    lengths = draw(st.lists(st.integers(1, steps), min_size=rows, max_size=rows))
    kinds = draw(st.lists(st.lists(st.booleans(), min_size=steps, max_size=steps), min_size=rows, max_size=rows))
    context = torch.arange(steps)[None, :] < torch.tensor(lengths)[:, None]  # [N, T]
    mask = context & torch.tensor(kinds)  # [N, T]
    values = st.floats(-8.0, 0.0, allow_nan=False, width=32)
    def table():
        return torch.tensor(draw(st.lists(st.lists(values, min_size=steps, max_size=steps), min_size=rows, max_size=rows)))
    adv = torch.tensor(draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=rows, max_size=rows)))[:, None]  # [N, 1]
    return mask, context, table(), table(), table(), adv


def agent_loss(lp, old, ref, adv, mask, kl=0.1):
    """agent_grpo's loss: PPO-clip plus k3 KL, both token means over the policy's tokens."""
    surrogate, *_ = F.get_loss("ppo_clip")(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    return surrogate + kl * F.token_mean(F.kl_k3(lp, ref), mask)


@settings(max_examples=60, deadline=None)
@given(trajectories(), st.data())
def test_observation_tokens_get_no_gradient_and_no_kl(batch, data):
    mask, context, lp, old, ref, adv = batch
    lp = lp.clone().requires_grad_(True)
    loss = agent_loss(lp, old, ref, adv, mask)
    loss.backward()
    assert (lp.grad[~mask] == 0).all()  # not a target of the surrogate, nor of the KL
    # anything at an observation (or padding) position, the policy's own log-prob included, leaves the loss as is
    noise = torch.tensor(data.draw(st.lists(st.floats(-30.0, 0.0, width=32), min_size=mask.numel(),
                                            max_size=mask.numel()))).view(mask.shape)
    moved = [torch.where(mask, value.detach(), noise) for value in (lp, old, ref)]
    assert torch.equal(agent_loss(*moved, adv, mask), loss.detach())


def _rollouts():
    executor = tiny_executor()
    ro, _, _ = executor.rollout(executor.current("policy"), EnvRef("env"), tiny_prompts(2), n=2, max_turns=2,
                                max_tokens_per_turn=3, max_total_tokens=14)
    return executor.models["policy"].model.eval(), ro


MODEL, RO = _rollouts()


def _insert_padding(ro: Rollouts, column: int, count: int) -> Rollouts:
    """`count` padding columns (mask and context False) inserted before response column `column`."""
    def widen(value, fill):
        pad = torch.full((value.shape[0], count), fill, dtype=value.dtype)
        return torch.cat([value[:, :column], pad, value[:, column:]], 1)  # [N, T + count]

    return attrs.evolve(ro, response_ids=widen(ro.response_ids, 0), mask=widen(ro.mask, False),
                        logprobs=widen(ro.logprobs, 0.0), context_mask=widen(ro.context_mask, False))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, RO.mask.shape[1]), st.integers(1, 4))
def test_padding_between_turns_does_not_change_the_logprobs_or_the_loss(column, count):
    """Positions count real tokens and padding is never attended to: the same log-probs at the
    same tokens, so the same loss (within the rounding of other matmul shapes: RTOL, tests/helpers.py)."""
    padded = _insert_padding(RO, column, count)
    with torch.no_grad():
        plain, wide = sequence_logprobs(MODEL, RO), sequence_logprobs(MODEL, padded)
    keep = torch.ones(padded.mask.shape[1], dtype=torch.bool)
    keep[column:column + count] = False
    torch.testing.assert_close(wide[:, keep], plain, rtol=RTOL, atol=RTOL * 8)
    adv = torch.linspace(-1, 1, len(RO))[:, None]  # [N, 1]
    a = agent_loss(plain, RO.logprobs, RO.logprobs, adv, RO.mask)
    b = agent_loss(wide, padded.logprobs, padded.logprobs, adv, padded.mask)
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL)
