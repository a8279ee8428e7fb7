import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlgraph.functional as F
import rlgraph.testing as rgt
from rlgraph.ir.ops import op_info

from ._batches import batch_shapes, random_batch, split_rows

AGGREGATIONS = [F.token_mean, F.seq_mean_token_sum, F.seq_mean_token_mean, F.seq_mean_token_sum_norm]

# rows: [1, 2, (3)], [4, (5), (6)]; (x) is masked. 3 tokens, 2 sequences, T = 3.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), **kw)


# -- statistics ---------------------------------------------------------------------------------


def test_masked_statistics_by_hand():
    close(F.masked_sum(VALUES, MASK), 7.0)
    close(F.masked_mean(VALUES, MASK), 7 / 3)
    close(F.masked_mean(VALUES, MASK, dim=-1), [1.5, 4.0])
    # deviations from 7/3: 16/9, 1/9, 25/9 -> 42/9; unbiased / 2, biased / 3
    close(F.masked_var(VALUES, MASK), 7 / 3)
    close(F.masked_var(VALUES, MASK, unbiased=False), 14 / 9)
    scale = 1 / math.sqrt(7 / 3 + 1e-8)
    expected = [[(1 - 7 / 3) * scale, (2 - 7 / 3) * scale, 0.0], [(4 - 7 / 3) * scale, 0.0, 0.0]]
    close(F.masked_whiten(VALUES, MASK), expected)
    shifted = F.masked_whiten(VALUES, MASK, shift_mean=False)
    close(shifted[0, 0], (1 - 7 / 3) * scale + 7 / 3)
    assert shifted[0, 2] == 0


def test_statistics_of_empty_and_single_masks_are_zero():
    nothing = torch.zeros_like(MASK)
    for stat in (F.masked_sum, F.masked_mean, F.masked_var):
        close(stat(VALUES, nothing), 0.0)
    close(F.masked_whiten(VALUES, nothing), torch.zeros_like(VALUES))
    single = torch.zeros_like(MASK)
    single[1, 1] = True
    close(F.masked_var(VALUES, single), 0.0)  # verl divides by zero here
    close(F.masked_whiten(VALUES, single), torch.zeros_like(VALUES))
    close(F.masked_whiten(torch.full((2, 3), 0.7), MASK), torch.zeros(2, 3))  # all equal -> 0


def test_statistics_ignore_the_loss_normalization_context():
    with F.loss_normalization(100, 100):
        close(F.masked_mean(VALUES, MASK), 7 / 3)


# -- aggregations -------------------------------------------------------------------------------


def test_aggregations_by_hand():
    close(F.token_mean(VALUES, MASK), 7 / 3)
    close(F.seq_mean_token_sum(VALUES, MASK), (3 + 4) / 2)
    close(F.seq_mean_token_mean(VALUES, MASK), (1.5 + 4) / 2)
    close(F.seq_mean_token_sum_norm(VALUES, MASK), 7 / (2 * 3))
    close(F.seq_mean_token_sum_norm(VALUES, MASK, horizon=7), 7 / (2 * 7))


def test_aggregations_use_global_counts_inside_the_context():
    with F.loss_normalization(tokens=6, sequences=4, horizon=10):
        close(F.token_mean(VALUES, MASK), 7 / 6)
        close(F.seq_mean_token_sum(VALUES, MASK), 7 / 4)
        close(F.seq_mean_token_mean(VALUES, MASK), 5.5 / 4)
        close(F.seq_mean_token_sum_norm(VALUES, MASK), 7 / 40)
        close(F.seq_mean_token_sum_norm(VALUES, MASK, horizon=5), 7 / 20)  # the argument wins
    close(F.token_mean(VALUES, MASK), 7 / 3)  # restored on exit


def test_loss_normalization_nests_clamps_and_accepts_tensors():
    assert F.active_loss_normalization() is None
    with F.loss_normalization(torch.tensor(6), torch.tensor(0)) as outer:
        assert outer.sequences == 1  # clamped to >= 1
        with F.loss_normalization(3, 3):
            close(F.token_mean(VALUES, MASK), 7 / 3)
        assert F.active_loss_normalization() is outer
        close(F.token_mean(VALUES, MASK), 7 / 6)
        close(F.seq_mean_token_sum(VALUES, MASK), 7.0)
    with F.loss_normalization(0, 0):
        close(F.token_mean(VALUES, MASK), 7.0)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        with F.loss_normalization(-1, 2):
            pass


def test_fully_masked_rows_and_batches():
    padded_values = torch.cat([VALUES, torch.full((1, 3), 9.0)])
    padded_mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    for agg in AGGREGATIONS:
        close(agg(padded_values, padded_mask), agg(VALUES, MASK))  # empty rows are not sequences
        close(agg(VALUES, torch.zeros_like(MASK)), 0.0)


def test_values_at_masked_positions_never_matter():
    garbage = VALUES.clone().requires_grad_(True)
    for agg in AGGREGATIONS + [F.masked_sum, F.masked_mean, F.masked_var]:
        dirty = torch.where(MASK, garbage, torch.tensor([[math.inf, math.nan, -math.inf]]))
        out = agg(dirty, MASK)
        close(out, agg(VALUES, MASK))
        (grad,) = torch.autograd.grad(out, garbage)
        assert torch.isfinite(grad).all() and (grad[~MASK] == 0).all()
    dirty = torch.where(MASK, garbage, math.nan)
    whitened = F.masked_whiten(dirty, MASK)
    close(whitened, F.masked_whiten(VALUES, MASK))
    (grad,) = torch.autograd.grad((whitened * VALUES).sum(), garbage)
    assert torch.isfinite(grad).all() and (grad[~MASK] == 0).all()


def test_global_counts():
    tokens, sequences = F.global_counts(torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)]))
    assert (tokens.item(), sequences.item()) == (3, 2)
    assert tokens.dtype == sequences.dtype == torch.int64


@given(batch_shapes())
def test_global_counts_add_up_over_micro_batches(shape):
    seed, n, t, pieces = shape
    mask = random_batch(seed, n, t)["mask"]
    parts = [F.global_counts(mask[rows]) for rows in split_rows(n, seed, pieces)]
    assert tuple(sum(p[i] for p in parts) for i in (0, 1)) == F.global_counts(mask)


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda agg: agg.__name__)
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch(agg):
    rgt.assert_microbatch_invariant(lambda b: agg(b.values, b.mask))


@given(batch_shapes(), st.sampled_from(AGGREGATIONS), st.integers(0, 3))
def test_padding_invariance(shape, agg, extra):
    seed, n, t, _ = shape
    batch = random_batch(seed, n, t)
    loss, mask = batch["values"], batch["mask"]
    reference = agg(loss, mask, **({"horizon": 9} if agg is F.seq_mean_token_sum_norm else {}))
    noise = torch.randn(n, t + extra, dtype=loss.dtype) * 1e3
    padded_mask = torch.cat([mask, torch.zeros(n, extra, dtype=torch.bool)], dim=1)
    padded = torch.where(padded_mask, torch.nn.functional.pad(loss, (0, extra)), noise)
    with F.loss_normalization(*F.global_counts(mask), horizon=9):
        torch.testing.assert_close(agg(padded, padded_mask), reference)


# -- tracing contract ---------------------------------------------------------------------------

N, T = 35, 11


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    "fn, args, kwargs, shapes",
    [
        (F.masked_sum, (meta(N, T), meta(N, T, dtype=torch.bool)), {}, [()]),
        (F.masked_mean, (meta(N, T), meta(N, T, dtype=torch.bool)), {"dim": -1}, [(N,)]),
        (F.masked_var, (meta(N, T), meta(N, T, dtype=torch.bool)), {}, [()]),
        (F.masked_whiten, (meta(N, T), meta(N, T, dtype=torch.bool)), {}, [(N, T)]),
        (F.global_counts, (meta(N, T, dtype=torch.bool),), {}, [(), ()]),
        *[(agg, (meta(N, T), meta(N, T, dtype=torch.bool)), {}, [()]) for agg in AGGREGATIONS],
    ],
)
def test_runs_on_meta_tensors(fn, args, kwargs, shapes):
    out = op_info(fn).impl(*args, **kwargs)  # what the tracer runs
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == shapes and all(o.device.type == "meta" for o in outs)
    with F.loss_normalization(torch.tensor(7), torch.tensor(3), horizon=5):
        op_info(fn).impl(*args, **kwargs)


def test_whitening_equal_values_gives_exactly_zero_not_rounding_noise():
    """Regression: 1/3 is not exact in float32, so a plain mean left ~1e-8 per value, which the
    whitening multiplied by 1/sqrt(1e-8) = 1e4. The mean is now taken after a shift."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert (F.masked_whiten(torch.full((2, 3), 1 / 3), mask) == 0).all()
    assert F.masked_var(torch.full((2, 3), 1 / 3), mask) == 0


def test_masked_max_by_hand_and_when_empty():
    close(F.masked_max(VALUES, MASK), 4.0)
    close(F.masked_max(VALUES, MASK, dim=-1), [2.0, 4.0])
    close(F.masked_max(-VALUES, MASK), -1.0)  # all negative: the largest unmasked, not 0
    close(F.masked_max(VALUES, torch.zeros_like(MASK)), 0.0)  # nothing unmasked: 0, as masked_mean
    close(F.masked_max(VALUES, torch.tensor([[True, False, False], [False, False, False]]), dim=-1), [1.0, 0.0])
    close(F.masked_max(torch.empty(2, 0), torch.empty(2, 0, dtype=torch.bool), dim=-1), [0.0, 0.0])
    dirty = torch.where(MASK, VALUES, torch.tensor([[math.inf, math.nan, math.nan]]))
    close(F.masked_max(dirty, MASK), 4.0)  # masked inf or NaN never wins
