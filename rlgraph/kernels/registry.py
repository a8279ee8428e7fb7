"""The kernel registry: name -> (torch reference, Triton implementation, the op it replaces).

    register("fused_gae", reference=gae_reference, triton=gae_triton, implements="gae")
    dispatch("fused_gae", torch.device("cuda"))(rewards, values, mask, gamma=1.0, lam=0.95)

`implements` names the `rlgraph.functional` op (or primitive) the kernel replaces; the `fuse`
pass maps op names to kernel names with `available_kernels()`. Both implementations take the
arguments of that op (plus, for losses, the global counts the executor passes explicitly).

Dispatch rule: CUDA tensors get the Triton kernel; CPU tensors get the torch reference, unless
TRITON_INTERPRET=1 is set, when they get the Triton kernel run by Triton's CPU interpreter (slow:
small shapes only). Without triton installed, every device gets the reference.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from rlgraph.kernels import advantages, logprob_head, policy_loss


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    implements: str
    reference: Callable
    triton: Callable
    # (args, kwargs) of one traced call -> why the kernel cannot run it, or None: the `fuse` pass
    # leaves such a call unfused (e.g. an aggregation the fused loss does not implement).
    declines: Callable[[tuple, dict], str | None] | None = None


_KERNELS: dict[str, Kernel] = {}


def register(name: str, *, reference: Callable, triton: Callable, implements: str,
             declines: Callable[[tuple, dict], str | None] | None = None) -> Kernel:
    """Add a kernel; names and the ops they implement are both unique."""
    if name in _KERNELS:
        raise ValueError(f"register: a kernel named {name!r} exists already")
    taken = [k.name for k in _KERNELS.values() if k.implements == implements]
    if taken:
        raise ValueError(f"register: {taken[0]!r} already implements {implements!r}; one kernel per op")
    kernel = Kernel(name, implements, reference, triton, declines)
    _KERNELS[name] = kernel
    return kernel


def _triton_usable(device: torch.device) -> bool:
    if logprob_head.triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def dispatch(name: str, device: torch.device | str) -> Callable:
    """The implementation of kernel `name` for tensors on `device` (see the module docstring)."""
    if name not in _KERNELS:
        raise KeyError(f"dispatch: no kernel named {name!r}; registered: {', '.join(sorted(_KERNELS))}")
    kernel = _KERNELS[name]
    return kernel.triton if _triton_usable(torch.device(device)) else kernel.reference


def available_kernels() -> tuple[Kernel, ...]:
    """Every registered kernel, in registration order."""
    return tuple(_KERNELS.values())


register("logprob_head", reference=logprob_head.token_logprobs_chunked, triton=logprob_head.token_logprobs_triton,
         implements="logprobs")
register("fused_ppo_clip", reference=policy_loss.ppo_clip_reference, triton=policy_loss.ppo_clip_triton,
         declines=policy_loss.unsupported_call,
         implements="ppo_clip")
register("fused_policy_loss", reference=policy_loss.policy_loss_reference, triton=policy_loss.policy_loss_triton,
         declines=policy_loss.unsupported_call, implements="policy_loss")
register("fused_group_normalize", reference=advantages.group_normalize_reference,
         triton=advantages.group_normalize_triton, implements="group_normalize")
register("fused_rloo", reference=advantages.rloo_reference, triton=advantages.rloo_triton, implements="rloo")
register("fused_reinforce_pp_baseline", reference=advantages.reinforce_pp_baseline_reference,
         triton=advantages.reinforce_pp_baseline_triton, implements="reinforce_pp_baseline")
register("fused_gae", reference=advantages.gae_reference, triton=advantages.gae_triton, implements="gae")
register("fused_discounted_returns", reference=advantages.discounted_returns_reference,
         triton=advantages.discounted_returns_triton, implements="discounted_returns")
