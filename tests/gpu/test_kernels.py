"""Every registered kernel, compiled by Triton for CUDA, against its torch reference: values and,
for the differentiable ones, gradients. The calls are the registry test's (`tests/kernels/_calls.py`)
at GPU sizes (several blocks per program); the per-kernel CUDA tests in tests/kernels add bf16
and the kernels' options.

UNTESTED: written on a machine without a GPU; these tests skip there. Tolerances: fp32 on both
sides, sums in another order: rtol 1e-4, and atol 1e-5 of each tensor's largest entry (a token-mean
loss's gradients are ~1/tokens, so a fixed atol would accept anything).
"""

import pytest
import torch

from rlgraph.kernels import logprob_head
from rlgraph.kernels.registry import available_kernels, dispatch
from tests.kernels._calls import kernel_calls

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Which positional arguments carry gradients: the log-prob head's hidden states and LM-head
# weight, the losses' log-probs. The advantage kernels run without autograd.
DIFFERENTIABLE = {"logprob_head": (0, 1), "fused_ppo_clip": (0,), "fused_policy_loss": (0,)}


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.is_cuda and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-7)


def _interpreted() -> bool:
    """Triton decides at import whether its kernels compile or run in the interpreter (TRITON_INTERPRET)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(logprob_head._head_fwd_kernel, InterpretedFunction)


def _floats(output) -> list[torch.Tensor]:
    outputs = output if isinstance(output, tuple) else (output,)
    return [value for value in outputs if isinstance(value, torch.Tensor) and value.is_floating_point()]


def _run(fn, args: tuple, differentiable: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(float outputs, gradients of a fixed random combination of them w.r.t. the differentiable args)."""
    args = tuple(arg.detach().clone().requires_grad_(index in differentiable) for index, arg in enumerate(args))
    outputs = _floats(fn(*args))
    if not differentiable:
        return outputs, []
    gen = torch.Generator().manual_seed(1)
    total = sum((out * torch.randn(out.shape, generator=gen).to(out.device)).sum()
                for out in outputs if out.requires_grad)
    return outputs, list(torch.autograd.grad(total, [args[index] for index in differentiable]))


@pytest.mark.skipif(logprob_head.triton is None, reason="triton is not installed")
@pytest.mark.parametrize("kernel", available_kernels(), ids=lambda kernel: kernel.name)
def test_the_compiled_kernel_matches_its_reference_on_cuda(kernel):
    if _interpreted():
        pytest.skip("Triton was imported in interpreter mode (tests/conftest.py sets TRITON_INTERPRET=1); "
                    "run `TRITON_INTERPRET=0 pytest -m gpu tests/gpu` to test the compiled kernels")
    assert dispatch(kernel.name, "cuda") is kernel.triton
    args = kernel_calls(rows=1024, steps=300, device="cuda")[kernel.name]
    differentiable = DIFFERENTIABLE.get(kernel.name, ())
    outputs, grads = _run(kernel.triton, args, differentiable)
    want_outputs, want_grads = _run(kernel.reference, args, differentiable)
    assert len(outputs) == len(want_outputs) and len(grads) == len(differentiable)
    for got, want in zip(outputs + grads, want_outputs + want_grads):
        _assert_close(got, want)
