"""Random rollout batches and micro-batch splits shared by the functional tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


def random_batch(seed: int, n: int, t: int, *, dtype: torch.dtype = torch.float64, token_adv: bool = False) -> dict:
    """A batch with ragged masks, some fully masked rows, and garbage at masked positions."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, t, generator=gen) > 0.3  # [N, T]
    mask[torch.rand(n, generator=gen) < 0.15] = False  # a few fully masked rows
    lp = -3 * torch.rand(n, t, generator=gen, dtype=dtype)  # [N, T]
    old_lp = lp + 0.3 * torch.randn(n, t, generator=gen, dtype=dtype)  # [N, T]
    adv = torch.randn(n, t if token_adv else 1, generator=gen, dtype=dtype)  # [N, T] or [N, 1]
    values = torch.randn(n, t, generator=gen, dtype=dtype)  # [N, T]
    return dict(
        lp=lp, old_lp=old_lp, adv=adv, mask=mask, values=values,
        old_values=values + 0.3 * torch.randn(n, t, generator=gen, dtype=dtype),
        returns=torch.randn(n, t, generator=gen, dtype=dtype),
        entropy=torch.rand(n, t, generator=gen, dtype=dtype),
    )


def split_rows(n: int, seed: int, pieces: int) -> list[torch.Tensor]:
    """A random partition of range(n) into `pieces` (<= n) non-empty, non-contiguous parts."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen)
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: pieces - 1].add(1).tolist())
    return [part for part in torch.tensor_split(order, cuts) if part.numel()]


@st.composite
def batch_shapes(draw, max_n: int = 8, max_t: int = 6):
    """(seed, N, T, pieces) for a micro-batch split."""
    n = draw(st.integers(1, max_n))
    return draw(st.integers(0, 2**31 - 1)), n, draw(st.integers(1, max_t)), draw(st.integers(1, n))
