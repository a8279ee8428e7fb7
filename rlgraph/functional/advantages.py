"""Advantage estimators: group baselines (GRPO, RLOO, OPO, GPG), REINFORCE++, ReMax and GAE.

Per-sequence estimators take outcome rewards f32[N] and return f32[N]; broadcast them over
tokens with `adv[:, None]`. Token-level ones take token rewards f32[N,T] (see
`rewards_at_last_token`) and return f32[N,T], 0 at masked positions.

`group` is i64[N]: the prompt each rollout answers, ids in [0, N); rows of a group need not be
contiguous. Group statistics use `index_add` / `scatter_reduce` into buffers of size N, so shapes
never depend on the data.

The group estimators whose inputs are rewards, groups and at most the mask are registered by name
at the end of this module (`F.get_estimator`, `rlgraph list`).

Edge cases, the same for every group estimator (verl differs for groups of size 1):
- a group of size 1 has no baseline information: its advantage is 0 (verl uses mean 0, std 1,
  so the raw reward passes through);
- all-equal rewards in a group give exactly 0 (statistics are taken relative to the group max,
  so the centring is exact);
- every result is finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlgraph.batches import BatchError
from rlgraph.functional.aggregate import as_mask, masked_whiten
from rlgraph.functional.registry import register_estimator
from rlgraph.ir.ops import traceable


def _group_sum(values: Tensor, group: Tensor) -> Tensor:
    """For each row, the sum of `values` over the row's group: [N] -> [N]."""
    totals = values.new_zeros(values.shape[0]).index_add(0, group, values)  # [N] indexed by group id
    return totals.index_select(0, group)  # [N]


def _check_groups(group: Tensor, rows: int, owner: str) -> None:
    """Group ids are i64 in [0, N): the buffers are N long, and index_add would raise a bare IndexError
    (or a dtype error) deep in torch. On concrete tensors only: tracing runs on meta tensors, which
    hold no values, and a compiled graph must not read them."""
    if group.dtype not in (torch.int64, torch.int32):
        raise BatchError(f"F.{owner}: group must hold integer ids (i64[N]), got {group.dtype}",
                         fix="pass rollouts.group, or group.long() for ids computed as floats")
    if group.is_meta or rows == 0 or torch.compiler.is_compiling() or torch._C._functorch.is_batchedtensor(group):
        return
    outside = ((group < 0) | (group >= rows)).nonzero()
    if outside.numel():
        row = int(outside[0])
        raise BatchError(f"F.{owner}: group id {int(group[row])} at row {row} is outside [0, N={rows}); "
                         f"{outside.numel()} row(s) of {rows} are",
                         fix="number each row's prompt from 0 within the batch (rollouts.group does: a shard's "
                             "ids are its own); renumber others with torch.unique(group, return_inverse=True)[1]")


def _group_centered(rewards: Tensor, group: Tensor, owner: str) -> tuple[Tensor, Tensor]:
    """(r - group mean, group size) per row; exactly 0 for groups whose rewards are all equal."""
    _check_groups(group, rewards.shape[0], owner)
    size = _group_sum(torch.ones_like(rewards), group)  # [N], >= 1
    peak = rewards.new_zeros(rewards.shape[0]).scatter_reduce(0, group, rewards, "amax", include_self=False)
    shifted = rewards - peak.index_select(0, group)  # [N], 0 at each group's max
    return shifted - _group_sum(shifted, group) / size, size  # [N], [N]


@traceable(rows="group")
def group_normalize(rewards: Tensor, group: Tensor, *, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), unbiased std over the rollout's group g.

    `scale=False` is Dr.GRPO: A_i = r_i - mean_g. Source: DeepSeekMath (GRPO), arXiv 2503.20783
    (Dr.GRPO); verl `compute_grpo_outcome_advantage`. Singleton groups give 0 (verl: r_i).
    """
    centered, size = _group_centered(rewards, group, "group_normalize")  # [N], [N]
    if not scale:
        return centered
    variance = _group_sum(centered.square(), group) / (size - 1).clamp(min=1)  # [N]
    return centered / (variance.sqrt() + eps)  # [N]


@traceable(rows="group")
def group_has_variance(rewards: Tensor, group: Tensor) -> Tensor:
    """bool[N]: True for rows whose group's rewards are not all equal (DAPO's dynamic-sampling test).

    Exactly the groups whose `group_normalize` advantages are not all 0; singleton groups give
    False. Source: DAPO, arXiv 2503.14476 (keep prompts with 0 < accuracy < 1). Use it as the
    `keep` of `rg.filter_groups`.
    """
    centered, _ = _group_centered(rewards, group, "group_has_variance")  # [N], exactly 0 for all-equal groups
    return _group_sum(centered.abs(), group) > 0  # [N]


@traceable(rows="group")
def rloo(rewards: Tensor, group: Tensor) -> Tensor:
    """RLOO: A_i = r_i - mean_{j in g, j != i} r_j = n / (n - 1) (r_i - mean_g).

    Source: arXiv 2402.14740; verl `compute_rloo_outcome_advantage`. Singleton groups give 0
    (verl: r_i).
    """
    centered, size = _group_centered(rewards, group, "rloo")  # [N], [N]
    return centered * size / (size - 1).clamp(min=1)  # [N]


@traceable
def reinforce_pp_baseline(rewards: Tensor, group: Tensor, mask: Tensor | None = None, *, eps: float = 1e-8) -> Tensor:
    """REINFORCE++-baseline: A = whiten(r_i - mean_g) over the batch.

    With `mask` bool[N,T] the whitening statistics weigh each rollout by its token count, as verl
    does (it whitens the [N,T] broadcast); without, each rollout weighs 1. Rows with no tokens
    give 0. Source: arXiv 2501.03262; verl `compute_reinforce_plus_plus_baseline_outcome_advantage`.
    """
    centered, _ = _group_centered(rewards, group, "reinforce_pp_baseline")  # [N]
    if mask is None:
        mask = torch.ones_like(rewards, dtype=torch.bool)[:, None]  # [N, 1]
    mask = as_mask(mask, "reinforce_pp_baseline")
    tiled = centered[:, None].expand(mask.shape)  # [N, T]
    whitened = masked_whiten(tiled, mask, eps=eps)  # [N, T]: each row's value on its tokens, 0 where masked
    per_row = torch.where(mask, whitened, -torch.inf).amax(dim=-1)  # [N] the row's value (-inf: no tokens)
    return torch.where(mask.any(dim=-1), per_row, 0.0)  # [N]


@traceable
def gpg(rewards: Tensor, group: Tensor, *, f_norm: float = 1.0) -> Tensor:
    """GPG: A_i = alpha (r_i - mean_g) / f_norm, alpha = N / max(#{i: r_i != 0}, 1).

    Source: arXiv 2504.02546; verl `compute_gpg_outcome_advantage` (same alpha). Singleton groups
    give 0 (verl: alpha r_i / f_norm).
    """
    centered, _ = _group_centered(rewards, group, "gpg")  # [N]
    alpha = rewards.shape[0] / torch.count_nonzero(rewards).clamp(min=1)  # []
    return alpha * centered / f_norm  # [N]


@traceable(rows="group")
def opo(rewards: Tensor, group: Tensor, mask: Tensor) -> Tensor:
    """OPO: A_i = r_i - b_g, b_g = sum_j |y_j| r_j / sum_j |y_j| (length-weighted group baseline).

    Source: arXiv 2505.23585; verl `compute_opo_outcome_advantage`. Singleton groups give 0 (verl:
    r_i); a group whose rows are all fully masked falls back to the plain group mean.
    """
    centered, _ = _group_centered(rewards, group, "opo")  # [N]
    length = as_mask(mask, "opo").sum(dim=-1).to(rewards.dtype)  # [N]
    length_total = _group_sum(length, group)  # [N]
    weighted = _group_sum(length * centered, group) / length_total.clamp(min=1)  # [N]
    return centered - torch.where(length_total > 0, weighted, 0.0)  # [N]


@traceable(rows="row")
def remax(rewards: Tensor, greedy_rewards: Tensor) -> Tensor:
    """ReMax: A_i = r_i - r_greedy(x_i), the reward of the greedy answer to the same prompt.

    Source: arXiv 2310.10505; verl `compute_remax_outcome_advantage` (for outcome rewards).
    """
    return rewards - greedy_rewards  # [N]


@traceable(rows="row")
def rewards_at_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """Token rewards f32[N,T] holding the outcome reward r_i at row i's last unmasked token.

    Fully masked rows are all 0.
    """
    mask = as_mask(mask, "rewards_at_last_token")
    positions = torch.arange(mask.shape[-1], device=mask.device)  # [T]
    last = torch.where(mask, positions, -1).amax(dim=-1)  # [N], -1 for empty rows
    at_last = positions == last[:, None]  # [N, T]
    return torch.where(at_last, rewards[:, None], 0.0)  # [N, T]


@traceable(rows="row")
def discounted_returns(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma G_{t'} over unmasked tokens, t' the next unmasked token: f32[N,T].

    Masked tokens are skipped (the return carries across them, undiscounted, as GAE does) and
    hold 0. verl's REINFORCE++ instead resets the return at a masked token; with trailing padding
    the two agree.
    """
    mask = as_mask(mask, "discounted_returns")
    rewards = torch.where(mask, rewards, 0.0)  # [N, T]
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    reversed_returns = []
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)  # [N]
        reversed_returns.append(running)
    returns = torch.stack(reversed_returns[::-1], dim=-1)  # [N, T]
    return torch.where(mask, returns, 0.0)


@traceable
def reinforce_pp(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8) -> Tensor:
    """REINFORCE++: A = masked_whiten(discounted_returns(r, mask, gamma)) over the batch: f32[N,T].

    Takes token rewards f32[N,T] (KL shaping included, if any). Source: arXiv 2501.03262; verl
    `compute_reinforce_plus_plus_outcome_advantage`.
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma=gamma), mask, eps=eps)  # [N, T]


@traceable(rows="row")
def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE: delta_t = r_t + gamma V_{t'} - V_t, A_t = delta_t + gamma lam A_{t'}; returns = A + V.

    t' is the next unmasked token: masked tokens (padding, tool observations) are skipped, their
    values and rewards ignored. Returns (advantages, returns), both f32[N,T] and 0 at masked
    positions. Source: arXiv 1506.02438; verl `compute_gae_advantage_return`, which also whitens
    the advantages: compose `masked_whiten(advantages, mask)` for that.
    """
    return _gae_scan(rewards, values, as_mask(mask, "gae"), gamma, lam)


def _gae_scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """GAE's backward scan; `lam` is one float or one lambda per row f32[N] (VAPO's length-adaptive one)."""
    rewards = torch.where(mask, rewards, 0.0)  # [N, T]
    values = torch.where(mask, values, 0.0)  # [N, T]
    next_value = values.new_zeros(values.shape[0])  # [N]
    advantage = values.new_zeros(values.shape[0])  # [N]
    reversed_advantages = []
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        advantage = torch.where(mask[:, t], delta + gamma * lam * advantage, advantage)  # [N]
        next_value = torch.where(mask[:, t], values[:, t], next_value)  # [N]
        reversed_advantages.append(advantage)
    advantages = torch.where(mask, torch.stack(reversed_advantages[::-1], dim=-1), 0.0)  # [N, T]
    return advantages, torch.where(mask, advantages + values, 0.0)


@traceable(rows="row")
def length_adaptive_lambda(mask: Tensor, *, alpha: float = 0.05) -> Tensor:
    """VAPO's length-adaptive GAE lambda f32[N]: lambda_i = 1 - 1 / (alpha * l_i), l_i = response tokens.

    Chosen so that sum_t lambda^t = 1 / (1 - lambda) = alpha * l: the number of TD errors an
    advantage averages grows with the response (arXiv 2504.05118, "Length-Adaptive GAE"; alpha = 0.05 there).
    Clamped to [0, 1]: below alpha * l = 1 the formula turns negative, which is no decay at all
    (rlgraph's choice; the paper's responses are long enough never to reach it). Empty rows get 0.
    """
    if not alpha > 0:
        raise ValueError(f"length_adaptive_lambda: alpha must be > 0, got {alpha}")
    length = as_mask(mask, "length_adaptive_lambda").sum(dim=-1).to(torch.float32)  # [N]
    return (1.0 - 1.0 / (alpha * length.clamp(min=1.0))).clamp(0.0, 1.0)  # [N]


@traceable(rows="row")
def decoupled_gae(rewards: Tensor, values: Tensor, mask: Tensor, lam_policy: float | Tensor, *, gamma: float = 1.0,
                  lam_critic: float = 1.0) -> tuple[Tensor, Tensor]:
    """Decoupled GAE (VC-PPO, arXiv 2503.01491; VAPO): one lambda for the policy, another for the critic.

        A_t = sum_l (gamma lam_policy)^l delta_{t+l}          the policy's advantages f32[N,T]
        R_t = V_t + sum_l (gamma lam_critic)^l delta_{t+l}    the critic's targets f32[N,T]

    With lam_critic = 1 the targets are the Monte-Carlo returns sum_l gamma^l r_{t+l}, unbiased
    whatever the value model says. `lam_policy` is a float or one per row (`length_adaptive_lambda`).
    Masked tokens are skipped as in `gae`.
    """
    mask = as_mask(mask, "decoupled_gae")
    advantages, _ = _gae_scan(rewards, values, mask, gamma, lam_policy)  # [N, T]
    _, returns = _gae_scan(rewards, values, mask, gamma, lam_critic)  # [N, T]
    return advantages, returns


# By name, for configs and the CLI: `F.get_estimator(name)(rewards, group, n=n, mask=mask)` calls the op
# itself, so programs print (and the fuse pass fuses) `group_normalize`, `rloo`, ... as when called directly.
register_estimator("group_normalize", group_normalize)
register_estimator("dr_grpo", group_normalize, hparams={"scale": False},
                   doc="Dr.GRPO: A_i = r_i - mean_g, i.e. group_normalize(scale=False): no division by the group std.")
register_estimator("rloo", rloo)
register_estimator("gpg", gpg)
register_estimator("reinforce_pp_baseline", reinforce_pp_baseline)
register_estimator("opo", opo)
