"""Kernel registry: dispatch rule, uniqueness, and that every kernel implements a real op."""

import pytest
import torch

from rlgraph.ir.ops import OPS
from rlgraph.ir.primitives import PRIMITIVES
from rlgraph.kernels import registry
from rlgraph.kernels.registry import available_kernels, dispatch, register
from tests.kernels._calls import kernel_calls

# Ops with no single `rlgraph.functional` counterpart: the composite loss (PPO + KL + entropy).
COMPOSITES = {"policy_loss"}


def test_every_kernel_implements_a_traced_op():
    for kernel in available_kernels():
        assert kernel.implements in OPS or kernel.implements in PRIMITIVES or kernel.implements in COMPOSITES, kernel


def test_names_and_ops_are_unique():
    kernels = available_kernels()
    assert len({k.name for k in kernels}) == len({k.implements for k in kernels}) == len(kernels)


def test_interpreter_flag_picks_triton_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for kernel in available_kernels():
        assert dispatch(kernel.name, "cpu") is kernel.triton


@pytest.mark.parametrize("flag", [None, "0"])
def test_plain_cpu_gets_the_reference(monkeypatch, flag):
    if flag is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", flag)
    for kernel in available_kernels():
        assert dispatch(kernel.name, torch.device("cpu")) is kernel.reference


def test_cuda_gets_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert dispatch("fused_gae", "cuda") is registry._KERNELS["fused_gae"].triton


def test_without_triton_everything_is_the_reference(monkeypatch):
    monkeypatch.setattr(registry.logprob_head, "triton", None)
    assert dispatch("fused_gae", "cuda") is registry._KERNELS["fused_gae"].reference


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="fused_gae"):
        dispatch("no_such_kernel", "cpu")


def test_register_refuses_duplicates(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
    with pytest.raises(ValueError, match="exists already"):
        register("fused_gae", reference=len, triton=len, implements="something_else")
    with pytest.raises(ValueError, match="already implements 'gae'"):
        register("another_gae", reference=len, triton=len, implements="gae")
    register("my_kernel", reference=len, triton=abs, implements="my_op")
    assert dispatch("my_kernel", "cuda") is abs


def test_both_implementations_agree_through_dispatch(monkeypatch):
    calls = kernel_calls()
    assert set(calls) == {k.name for k in available_kernels()}
    for name, args in calls.items():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        fast = dispatch(name, "cpu")(*args)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        slow = dispatch(name, "cpu")(*args)
        for x, y in zip(fast if isinstance(fast, tuple) else (fast,), slow if isinstance(slow, tuple) else (slow,)):
            if x is not None:
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
