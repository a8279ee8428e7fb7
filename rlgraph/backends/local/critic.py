"""A critic role: a causal-LM backbone with a linear value head (the `values` primitive).

`Critic.values(rollouts)` is V(s_t) f32[N,T] for each response position t: the value head applied
to the hidden state that predicts response token t (the state before the token is chosen), so
GAE's delta_t = r_t + gamma V_{t+1} - V_t lines up with the policy's log-prob of token t.
Masked positions hold 0. Differentiable; the local executor calls it with and without gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from rlgraph.backends.local.logprobs import response_hidden_states
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.batches import Rollouts


class Critic(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, *, seed: int = 0):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            self.value_head.weight.normal_(0.0, hidden ** -0.5)  # values start at O(1), not 0: gradients reach the backbone
            self.value_head.bias.zero_()

    def values(self, rollouts: Rollouts, *, packed: bool = False) -> torch.Tensor:
        hidden = response_hidden_states(self.backbone, rollouts, packed=packed)  # [N, T, H]
        values = self.value_head(hidden).squeeze(-1).float()  # [N, T]
        return torch.where(rollouts.mask.bool(), values, 0.0)  # [N, T]


def build_critic(source: Any = None, *, tokenizer: Any = None, seed: int = 0, backbone_seed: int | None = None,
                 **lm_options: Any) -> Critic:
    """A critic whose backbone is `build_causal_lm(source, ...)` (its LM head is unused), drawn with
    `backbone_seed` when given (the policy's seed: a critic that starts from the policy's weights),
    its value head with `seed`."""
    backbone = build_causal_lm(source, tokenizer=tokenizer, seed=seed if backbone_seed is None else backbone_seed,
                               **lm_options)
    return Critic(backbone, seed=seed)
