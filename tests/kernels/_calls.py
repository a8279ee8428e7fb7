"""One call of every registered kernel, at any size and on any device: shared by the registry's
CPU parity test (Triton interpreter vs reference) and tests/gpu (compiled Triton vs reference)."""

import torch


def kernel_calls(rows: int = 4, steps: int = 5, *, device: str = "cpu", seed: int = 0) -> dict[str, tuple]:
    """{kernel name: positional arguments}: per-token tensors [rows, steps], per-row [rows], groups
    of two rows, and `rows + 2` hidden states of width 4 over a vocabulary of 9 for the log-prob head."""
    gen = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(rows, steps, generator=gen), torch.randn(rows, steps, generator=gen)  # [R, S]
    mask = torch.rand(rows, steps, generator=gen) > 0.3  # [R, S]
    outcomes, group = torch.randint(0, 2, (rows,), generator=gen).float(), torch.arange(rows) // 2  # [R]
    lp, old = torch.randn(rows, steps, generator=gen), torch.randn(rows, steps, generator=gen)  # [R, S]
    hidden, weight = torch.randn(rows + 2, 4, generator=gen), torch.randn(9, 4, generator=gen)  # [M, H], [V, H]
    targets = torch.randint(0, 9, (rows + 2,), generator=gen)  # [M]
    calls = {
        "fused_group_normalize": (outcomes, group), "fused_rloo": (outcomes, group),
        "fused_reinforce_pp_baseline": (outcomes, group, mask), "fused_gae": (rewards, values, mask),
        "fused_discounted_returns": (rewards, mask), "fused_ppo_clip": (lp, old, outcomes, mask),
        "fused_policy_loss": (lp, old, outcomes, mask), "logprob_head": (hidden, weight, targets),
    }
    return {name: tuple(arg.to(device) for arg in args) for name, args in calls.items()}
