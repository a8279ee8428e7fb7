"""Chunked torch and Triton (interpreter) log-prob heads against the naive [M, V] oracle.

Tolerances: f32 log-probs/entropies atol 1e-4, f32 gradients atol 1e-4 + rtol 1e-4 (different
summation orders over V and H); bf16 inputs are compared with the oracle on the same bf16 values
at atol 2e-2 (gradients are rounded to bf16).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.kernels import logprob_head as head

IMPLS = {"chunked": head.token_logprobs_chunked, "triton": head.token_logprobs_triton}


def _inputs(M, V, H, seed, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(M, H, generator=gen) * scale).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (M,), generator=gen)
    return hidden, weight, targets


def _value_and_grads(fn, hidden, weight, targets, seed, **kw):
    """lp, entropy and d(sum g1*lp + g2*ent)/d(hidden, weight) for fixed random g1, g2."""
    lp, ent = fn(hidden, weight, targets, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    total = (lp * torch.randn(lp.shape, generator=gen).to(lp.device)).sum()
    if ent is not None:
        total = total + (ent * torch.randn(ent.shape, generator=gen).to(ent.device)).sum()
    grads = torch.autograd.grad(total, [hidden, weight])
    return lp, ent, grads


def _assert_matches(name, M, V, H, seed, atol=1e-4, dtype=torch.float32, scale=1.0, **kw):
    hidden, weight, targets = _inputs(M, V, H, seed, scale=scale, dtype=dtype)
    lp, ent, (gh, gw) = _value_and_grads(IMPLS[name], hidden, weight, targets, seed, **kw)
    lp_ref, ent_ref, (rh, rw) = _value_and_grads(head.token_logprobs_reference, hidden, weight, targets, seed,
                                                 temperature=kw.get("temperature", 1.0),
                                                 with_entropy=kw.get("with_entropy", False))
    assert lp.dtype == torch.float32 and lp.shape == (M,)
    torch.testing.assert_close(lp, lp_ref, atol=atol, rtol=1e-4)
    if kw.get("with_entropy"):
        torch.testing.assert_close(ent, ent_ref, atol=atol, rtol=1e-4)
    else:
        assert ent is None
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    torch.testing.assert_close(gh.float(), rh.float(), atol=atol, rtol=1e-4)
    torch.testing.assert_close(gw.float(), rw.float(), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", IMPLS)
@settings(max_examples=20, deadline=None)
@given(M=st.integers(1, 64), V=st.integers(2, 97), H=st.integers(1, 32), chunk=st.integers(1, 70),
       temperature=st.sampled_from([1.0, 0.6, 1.7]), with_entropy=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_reference(name, M, V, H, chunk, temperature, with_entropy, seed):
    _assert_matches(name, M, V, H, seed, chunk_size=chunk, temperature=temperature, with_entropy=with_entropy)


@pytest.mark.parametrize("name", IMPLS)
def test_large_logits_are_stable(name):
    # hidden * 30 gives logits in the hundreds: a naive exp would overflow.
    _assert_matches(name, 20, 41, 8, seed=3, atol=2e-3, scale=30.0, with_entropy=True, chunk_size=7)


@pytest.mark.parametrize("name", IMPLS)
def test_ties_give_uniform_distribution(name):
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.zeros(13, 4, requires_grad=True)  # every logit 0: a 13-way tie
    lp, ent = IMPLS[name](hidden, weight, torch.arange(5), with_entropy=True)
    torch.testing.assert_close(lp, torch.full((5,), -math.log(13)))
    torch.testing.assert_close(ent, torch.full((5,), math.log(13)))
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(hidden.grad, torch.zeros(5, 4))  # W = 0, so no signal reaches hidden


@pytest.mark.parametrize("name", IMPLS)
def test_bf16_inputs(name):
    hidden, weight, targets = _inputs(24, 37, 16, seed=5, dtype=torch.bfloat16)
    lp, ent, (gh, gw) = _value_and_grads(IMPLS[name], hidden, weight, targets, 5, with_entropy=True, chunk_size=10)
    lp_ref, ent_ref, (rh, rw) = _value_and_grads(head.token_logprobs_reference, hidden, weight, targets, 5,
                                                 with_entropy=True)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(lp, lp_ref, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(ent, ent_ref, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(gh.float(), rh.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", IMPLS)
def test_entropy_output_unused_and_weight_frozen(name):
    hidden, weight, targets = _inputs(9, 11, 5, seed=7)
    weight = weight.detach()
    lp, ent = IMPLS[name](hidden, weight, targets, with_entropy=True)
    lp.sum().backward()  # ent takes no part: its gradient arrives as None (no entropy backward work)
    h2 = hidden.detach().requires_grad_()
    head.token_logprobs_reference(h2, weight, targets)[0].sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", IMPLS)
def test_no_tokens(name):
    lp, ent = IMPLS[name](torch.zeros(0, 4), torch.randn(7, 4), torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,)


def test_cpu_default_is_the_chunked_torch_path(monkeypatch):
    monkeypatch.setattr(head, "token_logprobs_triton", lambda *a, **k: pytest.fail("Triton ran on CPU"))
    hidden, weight, targets = _inputs(6, 9, 4, seed=1)
    lp, ent = head.token_logprobs(hidden, weight, targets)
    torch.testing.assert_close(lp, head.token_logprobs_reference(hidden, weight, targets)[0])
    assert ent is None


def test_forward_never_holds_full_logits():
    """Peak CPU allocation of the chunked forward+backward stays far below one [M, V] f32 block."""
    M, V, H, chunk = 512, 2000, 16, 32
    hidden, weight, targets = _inputs(M, V, H, seed=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        lp, ent = head.token_logprobs_chunked(hidden, weight, targets, with_entropy=True, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert 0 < largest <= 4 * chunk * V * 4 < M * V * 4


@pytest.mark.parametrize("bad", [dict(hidden=(3, 4), weight=(5, 3), targets=(3,)),
                                 dict(hidden=(3, 4), weight=(5, 4), targets=(2,))])
def test_shape_errors_name_the_shapes(bad):
    with pytest.raises(ValueError, match="hidden \\[M, H\\]"):
        head.token_logprobs(torch.zeros(bad["hidden"]), torch.zeros(bad["weight"]),
                            torch.zeros(bad["targets"], dtype=torch.long))


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        head.token_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), temperature=0.0)


def test_autocast_leaves_the_chunked_head_in_fp32():
    """The local executor runs its forwards under bf16 autocast on CUDA; the head still computes fp32
    log-probs (its matmuls write into fp32 buffers, which autocast does not touch). CPU autocast here."""
    hidden, weight, targets = _inputs(30, 17, 8, seed=5)
    plain, _ = head.token_logprobs_chunked(hidden, weight, targets, chunk_size=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = head.token_logprobs_chunked(hidden, weight, targets, chunk_size=7)
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1000, 256, generator=gen).to("cuda", dtype).requires_grad_()
    weight = (torch.randn(5003, 256, generator=gen) / 16).to("cuda", dtype).requires_grad_()
    targets = torch.randint(0, 5003, (1000,), generator=gen).cuda()
    atol = 1e-3 if dtype == torch.float32 else 3e-2
    lp, ent, (gh, gw) = _value_and_grads(head.token_logprobs, hidden, weight, targets, 0, with_entropy=True,
                                         temperature=0.8, chunk_size=300)
    lp_ref, ent_ref, (rh, rw) = _value_and_grads(head.token_logprobs_reference, hidden, weight, targets, 0,
                                                 with_entropy=True, temperature=0.8)
    torch.testing.assert_close(lp, lp_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(ent, ent_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(gh.float(), rh.float(), atol=atol, rtol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), atol=atol, rtol=2e-2)
