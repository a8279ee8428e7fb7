"""Per-token log-probs (and entropy) from hidden states and the LM-head weight, chunked.

    logits = hidden @ weight.T / temperature          # never held whole: [chunk, V] at a time
    lp[m]  = logits[m, targets[m]] - logsumexp(logits[m])
    H[m]   = logsumexp(logits[m]) - sum_v softmax(logits[m])_v * logits[m, v]

The autograd function saves only the inputs and recomputes each chunk's logits in backward, so
the [M, V] float32 logits never exist at once, forward or backward.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024


def _chunk_forward(hidden, weight, targets, temperature, with_entropy):
    logits = (hidden @ weight.t()).float() / temperature          # [c, V]
    lse = torch.logsumexp(logits, dim=-1)                         # [c]
    lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse    # [c]
    if not with_entropy:
        return lp, None
    probs = torch.softmax(logits, dim=-1)                         # [c, V]
    return lp, lse - (probs * logits).sum(-1)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk):
        lps, ents = [], []
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                lp, ent = _chunk_forward(hidden[start:start + chunk], weight, targets[start:start + chunk], temperature, with_entropy)
                lps.append(lp)
                ents.append(ent)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        lp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
        entropy = torch.cat(ents) if with_entropy and ents else hidden.new_zeros(lp.shape, dtype=torch.float32)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            h = hidden[start:stop].detach().requires_grad_(ctx.needs_input_grad[0])
            w = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            with torch.enable_grad():
                lp, ent = _chunk_forward(h, w, targets[start:stop], ctx.temperature, ctx.with_entropy)
                total = (lp * grad_lp[start:stop]).sum()
                if ctx.with_entropy:
                    total = total + (ent * grad_entropy[start:stop]).sum()
                grads = torch.autograd.grad(total, [t for t, need in ((h, ctx.needs_input_grad[0]), (w, ctx.needs_input_grad[1])) if need])
            grads = list(grads)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grads.pop(0)
            if grad_weight is not None:
                grad_weight += grads.pop(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs f32[M] of `targets` (and entropy f32[M] if asked) from hidden[M,H] and weight[V,H]."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: need hidden [M,H], weight [V,H], targets [M]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    lp, entropy = _TokenLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy, chunk_size or DEFAULT_CHUNK)
    return lp, (entropy if with_entropy else None)
