"""Advantage kernels: segmented group statistics (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) and
reverse scans over [N, T] (GAE, discounted returns).

Same contracts and edge cases as `rlgraph.functional.advantages`, whose ops they replace:

    group_normalize        A_i = (r_i - mean_g) / (std_g + eps)   (unbiased std; scale=False: r_i - mean_g)
    rloo                   A_i = n_g / (n_g - 1) (r_i - mean_g)   (leave-one-out baseline)
    reinforce_pp_baseline  A = whiten(r_i - mean_g) over the batch, rows weighted by their token count
    gae                    delta_t = r_t + gamma V_t' - V_t,  A_t = delta_t + gamma lam A_t',  R_t = A_t + V_t
    discounted_returns     G_t = r_t + gamma G_t'

`group` is i64[N] with ids in [0, N); rows of a group need not be contiguous. Convention: a group
of size 1 has no baseline information and gets advantage 0 (verl passes its raw reward through).
Group statistics are taken relative to the group max, so a group of equal rewards gives exactly 0.
In the scans t' is the next *unmasked* token: masked tokens are skipped and hold 0.

The Triton group kernel gives each block of rows one sweep over all N rows per statistic (max,
mean, variance), comparing group ids: O(N^2 / BLOCK) work, deterministic, no atomics, and no
sort; N (rollouts per mini-batch, thousands at most) keeps it well under a millisecond on a GPU.
The scans walk T backwards with BLOCK_N rows per program.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Modes of the group kernel.
GRPO, CENTERED, RLOO = 0, 1, 2


def _check_group(rewards: Tensor, group: Tensor, name: str) -> None:
    if rewards.dim() != 1 or group.shape != rewards.shape:
        raise ValueError(f"{name}: need rewards f32[N] and group i64[N]; got {tuple(rewards.shape)}, "
                         f"{tuple(group.shape)}")


def _check_scan(rewards: Tensor, mask: Tensor, name: str, values: Tensor | None = None) -> None:
    if rewards.dim() != 2 or mask.shape != rewards.shape or (values is not None and values.shape != rewards.shape):
        raise ValueError(f"{name}: rewards, values and mask must share one shape [N, T]; got {tuple(rewards.shape)}, "
                         f"{None if values is None else tuple(values.shape)}, {tuple(mask.shape)}")


# ----------------------------------------------------------------------------- reference


def _per_group(values: Tensor, group: Tensor) -> Tensor:
    """Each row's group total of `values`: [N] -> [N]."""
    return values.new_zeros(values.shape[0]).index_add_(0, group, values).index_select(0, group)


def _group_centered(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """(r_i - mean_g, n_g) per row, both f32[N]; exactly 0 for all-equal groups."""
    size = _per_group(torch.ones_like(rewards), group)  # [N]
    peak = rewards.new_full(rewards.shape, -torch.inf).scatter_reduce_(0, group, rewards, "amax")  # [N] by id
    shifted = rewards - peak.index_select(0, group)  # [N]
    return shifted - _per_group(shifted, group) / size, size


def group_normalize_reference(rewards: Tensor, group: Tensor, *, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """GRPO advantages f32[N] (torch); `scale=False` is Dr.GRPO's r_i - mean_g."""
    _check_group(rewards, group, "group_normalize")
    centered, size = _group_centered(rewards.float(), group)  # [N], [N]
    if not scale:
        return centered
    std = (_per_group(centered.square(), group) / (size - 1).clamp(min=1)).sqrt()  # [N]
    return centered / (std + eps)


def rloo_reference(rewards: Tensor, group: Tensor) -> Tensor:
    """RLOO advantages f32[N] (torch): r_i minus the mean of the other rows of its group."""
    _check_group(rewards, group, "rloo")
    centered, size = _group_centered(rewards.float(), group)  # [N], [N]
    return centered * size / (size - 1).clamp(min=1)


def _row_weights(rewards: Tensor, mask: Tensor | None) -> Tensor:
    """Whitening weight of each row f32[N]: its token count, or 1 without a mask."""
    return torch.ones_like(rewards) if mask is None else mask.to(torch.bool).sum(-1).to(rewards.dtype)


def reinforce_pp_baseline_reference(rewards: Tensor, group: Tensor, mask: Tensor | None = None, *,
                                    eps: float = 1e-8) -> Tensor:
    """REINFORCE++-baseline f32[N] (torch): (c_i - mean_w c) / sqrt(var_w c + eps), c = r - mean_g.

    mean_w and var_w (unbiased, over sum(w) samples) weigh row i by w_i, its token count; rows
    with no tokens give 0.
    """
    _check_group(rewards, group, "reinforce_pp_baseline")
    centered, _ = _group_centered(rewards.float(), group)  # [N]
    weights = _row_weights(centered, mask)  # [N]
    total = weights.sum()
    # Shifted by the largest weighted value: all-equal values whiten to exactly 0, not to rounding
    # noise times 1/sqrt(eps) (the same rule as rlgraph.functional.masked_whiten).
    shift = torch.where(weights > 0, centered, -torch.inf).amax() if bool((weights > 0).any()) else 0.0
    shifted = torch.where(weights > 0, centered - shift, 0.0)  # [N]
    mean = (weights * shifted).sum() / total.clamp(min=1)
    var = (weights * (shifted - mean).square()).sum() / (total - 1).clamp(min=1)
    return torch.where(weights > 0, (shifted - mean) * torch.rsqrt(var + eps), 0.0)


def gae_reference(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
                  lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE (advantages, returns), both f32[N, T], 0 where masked (torch loop over T)."""
    _check_scan(rewards, mask, "gae", values)
    mask = mask.to(torch.bool)
    rewards = torch.where(mask, rewards.float(), 0.0)  # [N, T]
    values = torch.where(mask, values.float(), 0.0)  # [N, T]
    advantages = torch.zeros_like(rewards)  # [N, T]
    next_value = rewards.new_zeros(rewards.shape[0])  # [N]
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        running = torch.where(mask[:, t], delta + gamma * lam * running, running)  # [N]
        next_value = torch.where(mask[:, t], values[:, t], next_value)  # [N]
        advantages[:, t] = running
    advantages = torch.where(mask, advantages, 0.0)
    return advantages, torch.where(mask, advantages + values, 0.0)


def discounted_returns_reference(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """G f32[N, T], 0 where masked (torch loop over T)."""
    _check_scan(rewards, mask, "discounted_returns")
    mask = mask.to(torch.bool)
    rewards = torch.where(mask, rewards.float(), 0.0)  # [N, T]
    returns = torch.zeros_like(rewards)  # [N, T]
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)  # [N]
        returns[:, t] = running
    return torch.where(mask, returns, 0.0)


# ----------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _same_group(g_rows, group_ptr, j0, N, BLOCK: tl.constexpr):
        """(same [BLOCK, BLOCK] membership of rows vs columns j0.., column indices)."""
        cols = j0 + tl.arange(0, BLOCK)
        g_cols = tl.load(group_ptr + cols, mask=cols < N, other=-1)
        return (g_rows[:, None] == g_cols[None, :]) & (cols[None, :] < N), cols

    @triton.jit
    def _group_kernel(r_ptr, group_ptr, out_ptr, N, eps, MODE: tl.constexpr, BLOCK: tl.constexpr):
        """Per row: group max, size, centred reward (and unbiased std); then the mode's advantage."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        row_ok = rows < N
        g_rows = tl.load(group_ptr + rows, mask=row_ok, other=-2)
        r_rows = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        peak = tl.full((BLOCK,), float("-inf"), tl.float32)
        size = tl.zeros((BLOCK,), tl.float32)
        for j0 in range(0, N, BLOCK):
            same, cols = _same_group(g_rows, group_ptr, j0, N, BLOCK)
            r_cols = tl.load(r_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.max(tl.where(same, r_cols[None, :], float("-inf")), axis=1))
            size += tl.sum(same.to(tl.float32), axis=1)
        peak = tl.where(row_ok, peak, 0.0)
        shifted_sum = tl.zeros((BLOCK,), tl.float32)
        for j0 in range(0, N, BLOCK):
            same, cols = _same_group(g_rows, group_ptr, j0, N, BLOCK)
            r_cols = tl.load(r_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            shifted_sum += tl.sum(tl.where(same, r_cols[None, :] - peak[:, None], 0.0), axis=1)
        size = tl.maximum(size, 1.0)
        mean_shifted = shifted_sum / size
        centered = (r_rows - peak) - mean_shifted
        if MODE == 0:
            squares = tl.zeros((BLOCK,), tl.float32)
            for j0 in range(0, N, BLOCK):
                same, cols = _same_group(g_rows, group_ptr, j0, N, BLOCK)
                r_cols = tl.load(r_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                dev = r_cols[None, :] - peak[:, None] - mean_shifted[:, None]
                squares += tl.sum(tl.where(same, dev * dev, 0.0), axis=1)
            out = centered / (tl.sqrt(squares / tl.maximum(size - 1.0, 1.0)) + eps)
        elif MODE == 1:
            out = centered
        else:
            out = centered * size / tl.maximum(size - 1.0, 1.0)
        tl.store(out_ptr + rows, out, mask=row_ok)

    @triton.jit
    def _whiten_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
        """One program: out = (x - mean_w) / sqrt(var_w + eps) where w > 0, else 0.

        x is shifted by its largest weighted value first, so all-equal values give exactly 0."""
        largest = tl.full((BLOCK,), float("-inf"), tl.float32)
        for i0 in range(0, N, BLOCK):
            idx = i0 + tl.arange(0, BLOCK)
            w = tl.load(w_ptr + idx, mask=idx < N, other=0.0)
            x = tl.load(x_ptr + idx, mask=idx < N, other=0.0)
            largest = tl.maximum(largest, tl.where(w > 0, x, float("-inf")))
        shift = tl.max(largest, axis=0)
        shift = tl.where(shift == float("-inf"), 0.0, shift)
        total = tl.zeros((BLOCK,), tl.float32)
        weighted = tl.zeros((BLOCK,), tl.float32)
        for i0 in range(0, N, BLOCK):
            idx = i0 + tl.arange(0, BLOCK)
            w = tl.load(w_ptr + idx, mask=idx < N, other=0.0)
            total += w
            weighted += w * tl.where(w > 0, tl.load(x_ptr + idx, mask=idx < N, other=0.0) - shift, 0.0)
        count = tl.sum(total, axis=0)
        mean = tl.sum(weighted, axis=0) / tl.maximum(count, 1.0)
        squares = tl.zeros((BLOCK,), tl.float32)
        for i0 in range(0, N, BLOCK):
            idx = i0 + tl.arange(0, BLOCK)
            w = tl.load(w_ptr + idx, mask=idx < N, other=0.0)
            dev = tl.where(w > 0, tl.load(x_ptr + idx, mask=idx < N, other=0.0) - shift - mean, 0.0)
            squares += w * dev * dev
        inv_std = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / tl.maximum(count - 1.0, 1.0) + eps)
        for i0 in range(0, N, BLOCK):
            idx = i0 + tl.arange(0, BLOCK)
            w = tl.load(w_ptr + idx, mask=idx < N, other=0.0)
            x = tl.load(x_ptr + idx, mask=idx < N, other=0.0)
            tl.store(out_ptr + idx, tl.where(w > 0, (x - shift - mean) * inv_std, 0.0), mask=idx < N)

    @triton.jit
    def _reverse_scan_kernel(r_ptr, v_ptr, mask_ptr, adv_ptr, ret_ptr, N, T, gamma, lam,
                             GAE: tl.constexpr, BLOCK_N: tl.constexpr):
        """BLOCK_N rows, t = T-1 .. 0: GAE (advantages, returns) or discounted returns (into adv_ptr)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_ok = rows < N
        running = tl.zeros((BLOCK_N,), tl.float32)
        next_value = tl.zeros((BLOCK_N,), tl.float32)
        for step in range(0, T):
            offs = rows * T + (T - 1 - step)
            m = (tl.load(mask_ptr + offs, mask=row_ok, other=0) != 0) & row_ok
            r = tl.where(m, tl.load(r_ptr + offs, mask=row_ok, other=0.0).to(tl.float32), 0.0)
            if GAE:
                v = tl.where(m, tl.load(v_ptr + offs, mask=row_ok, other=0.0).to(tl.float32), 0.0)
                delta = r + gamma * next_value - v
                running = tl.where(m, delta + gamma * lam * running, running)
                next_value = tl.where(m, v, next_value)
                tl.store(ret_ptr + offs, tl.where(m, running + v, 0.0), mask=row_ok)
            else:
                running = tl.where(m, r + gamma * running, running)
            tl.store(adv_ptr + offs, tl.where(m, running, 0.0), mask=row_ok)


def _block(n: int, device: torch.device, cap: int) -> int:
    return min(max(triton.next_power_of_2(max(n, 1)), 16), 16 if device.type == "cpu" else cap)


def _group_triton(rewards: Tensor, group: Tensor, mode: int, eps: float) -> Tensor:
    rewards, group = rewards.float().contiguous(), group.contiguous()
    out = torch.empty_like(rewards)  # [N]
    block = _block(rewards.shape[0], rewards.device, 128)
    if rewards.shape[0]:
        _group_kernel[(triton.cdiv(rewards.shape[0], block),)](rewards, group, out, rewards.shape[0], float(eps),
                                                               MODE=mode, BLOCK=block)
    return out


def group_normalize_triton(rewards: Tensor, group: Tensor, *, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Triton `group_normalize_reference`."""
    _check_group(rewards, group, "group_normalize")
    return _group_triton(rewards, group, GRPO if scale else CENTERED, eps)


def rloo_triton(rewards: Tensor, group: Tensor) -> Tensor:
    """Triton `rloo_reference`."""
    _check_group(rewards, group, "rloo")
    return _group_triton(rewards, group, RLOO, 0.0)


def reinforce_pp_baseline_triton(rewards: Tensor, group: Tensor, mask: Tensor | None = None, *,
                                 eps: float = 1e-8) -> Tensor:
    """Triton `reinforce_pp_baseline_reference`: the group kernel, then a one-program whitening."""
    _check_group(rewards, group, "reinforce_pp_baseline")
    centered = _group_triton(rewards, group, CENTERED, 0.0)  # [N]
    weights = _row_weights(centered, mask).contiguous()  # [N]
    out = torch.empty_like(centered)
    if centered.shape[0]:
        _whiten_kernel[(1,)](centered, weights, out, centered.shape[0], float(eps),
                             BLOCK=_block(centered.shape[0], centered.device, 1024))
    return out


def _scan_triton(rewards: Tensor, values: Tensor | None, mask: Tensor, gamma: float, lam: float):
    N, T = rewards.shape
    is_gae = values is not None
    rewards = rewards.float().contiguous()
    values = values.float().contiguous() if is_gae else rewards
    mask = mask.to(torch.bool).contiguous().view(torch.uint8)
    first, second = torch.empty_like(rewards), torch.empty_like(rewards)  # [N, T]
    block = 16 if rewards.device.type == "cpu" else 64
    if N and T:
        _reverse_scan_kernel[(triton.cdiv(N, block),)](rewards, values, mask, first, second, N, T, float(gamma),
                                                       float(lam), GAE=is_gae, BLOCK_N=block)
    return first, second


def gae_triton(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
               lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Triton `gae_reference`: (advantages, returns) f32[N, T]."""
    _check_scan(rewards, mask, "gae", values)
    return _scan_triton(rewards, values, mask, gamma, lam)


def discounted_returns_triton(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Triton `discounted_returns_reference`: f32[N, T]."""
    _check_scan(rewards, mask, "discounted_returns")
    return _scan_triton(rewards, None, mask, gamma, 1.0)[0]
