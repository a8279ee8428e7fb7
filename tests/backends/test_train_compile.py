"""The update's forward under torch.compile (`rlgraph.backends.local.train_compile`): the same
step as eager, and `train.compile: auto` decided by the measured break-even."""

from __future__ import annotations

import pytest
import torch

from rlgraph.backends.local.train_compile import AUTO_MIN_FORWARDS, resolve_train_compile
from rlgraph.errors import ConfigError
from rlgraph.runtime.eager import Interpreter
from rlgraph.testing.tiny import tiny_executor
from tests.backends.test_packing import clipped_surrogate, ragged_rollouts


@pytest.mark.parametrize("mode, device, forwards, expected", [
    ("on", "cpu", 1, True), ("on", "cuda", None, True), ("off", "cpu", 10 ** 9, False),
    ("auto", "cpu", AUTO_MIN_FORWARDS, True), ("auto", "cpu", AUTO_MIN_FORWARDS - 1, False),
    ("auto", "cpu", None, False),  # a run bounded by seconds: no count, no compile
    ("auto", "cuda", 10 ** 9, False),  # nothing measured on a GPU
])
def test_auto_compiles_only_where_the_measured_break_even_is_passed(mode, device, forwards, expected):
    assert resolve_train_compile(mode, device, forwards) is expected


@pytest.mark.parametrize("bad", ["yes", "ON", True, None])
def test_a_bad_mode_is_named(bad):
    with pytest.raises(ConfigError, match=f"train.compile={bad!r} is not one of 'auto', 'on', 'off'"):
        resolve_train_compile(bad, "cpu", 1)


@pytest.mark.slow
def test_the_compiled_update_equals_the_eager_one():
    """One micro-batch shape (two micro-batches of 3 rows), so one Inductor compile (~1 min on a
    loaded 2-core machine). Inductor may fuse and reorder fp32 arithmetic: metrics within rel 1e-5,
    weights after the SGD step within 1e-6 (observed: ~1e-8)."""
    batch = ragged_rollouts([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7, seed=3)
    runs = []
    for compiled in (False, True):
        executor = tiny_executor(lr=0.1)
        executor.compile_train = compiled
        metrics = Interpreter(executor).run(clipped_surrogate.trace(micro_batch_size=3), batch)[1]
        runs.append((metrics, [p.detach().clone() for p in executor.models["policy"].model.parameters()]))
    (eager, eager_weights), (compiled, compiled_weights) = runs
    assert compiled.keys() == eager.keys()
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-5), key
    for mine, theirs in zip(compiled_weights, eager_weights):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


SHAPES = [([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7), ([3, 2], [2, 1], 3, 2), ([7, 7, 1, 2], [4, 4, 4, 0], 7, 4),
          ([1, 2, 3], [5, 6, 1], 4, 6), ([4, 4, 4, 4, 4], [3, 1, 2, 3, 3], 5, 3)]  # (prompt lengths, response lengths, P, T)


def _graphs_over_changing_shapes(monkeypatch, **hparams) -> list[int]:
    """Five updates of `SHAPES` on an eager and a compiled tiny policy: the graphs compiled after
    each, checking metrics and weights against eager. Dynamo's guards do not depend on the backend,
    so a counting `aot_eager` stands in for Inductor (no compile minutes); it runs the same aten ops
    as eager, so metrics and weights agree within fp32 rounding (rel 1e-5; weights after SGD at lr
    0.1 within 1e-6)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from rlgraph.backends.local import train_compile
    from rlgraph.backends.local.logprobs import role_outputs

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(train_compile, "compiled_role_outputs", lambda *_: torch.compile(role_outputs, backend=counter))
    torch._dynamo.reset()
    executors = {compiled: tiny_executor(lr=0.1) for compiled in (False, True)}
    executors[True].compile_train = True
    graphs = []
    for k, (prompts, responses, width, steps) in enumerate(SHAPES):
        batch = ragged_rollouts(prompts, responses, width, steps, seed=k)
        eager, compiled = (Interpreter(executors[c]).run(clipped_surrogate.trace(**hparams), batch)[1]
                           for c in (False, True))
        graphs.append(counter.frame_count)
        assert compiled.keys() == eager.keys()
        for key, value in eager.items():
            assert compiled[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (k, key)
    torch._dynamo.reset()
    weights = zip(*(executors[c].models["policy"].model.parameters() for c in (False, True)))
    for eager_weight, compiled_weight in weights:
        torch.testing.assert_close(compiled_weight, eager_weight, rtol=0, atol=1e-6)
    return graphs


def test_updates_of_changing_shapes_reuse_one_graph_and_equal_eager(monkeypatch):
    """Rows (2..6), prompt width (3..7), response width (2..7) and real-token count all change;
    every update reuses the one dynamic graph of the first (`mark_dynamic_shapes`; the LM head
    with its data-dependent token count runs eager, `logprobs.masked_head`)."""
    graphs = _graphs_over_changing_shapes(monkeypatch)
    assert graphs == [1] * len(SHAPES), f"graphs compiled after each update: {graphs}"


def test_packed_updates_compile_a_bounded_number_of_graphs(monkeypatch):
    """Packed micro-batches (of at most 16 tokens: 1-3 rows each) around two graph breaks (the
    packing and the head run eager): each of the three compiled pieces compiles at most a static,
    a dynamic and a one-row graph (Dynamo specialises sizes 0 and 1), so at most 9, and the last
    shapes add none (with the packing compiled too: 17 and still growing)."""
    graphs = _graphs_over_changing_shapes(monkeypatch, micro_batch_tokens=16)
    assert graphs[-1] <= 9 and graphs[-2] == graphs[-1], f"graphs compiled after each update: {graphs}"


def _counting_compile(monkeypatch):
    """A counting `aot_eager` backend in place of Inductor (Dynamo's guards do not depend on the backend)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from rlgraph.backends.local import train_compile
    from rlgraph.backends.local.logprobs import role_outputs

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(train_compile, "compiled_role_outputs", lambda *_: torch.compile(role_outputs, backend=counter))
    torch._dynamo.reset()
    return counter


def head_bound(logprobs: torch.Tensor, hidden: int = 64) -> float:
    """How far the compiled forward's LM head (`all_positions_head`, over every position) may move
    a log-prob or entropy from eager's chunked head (over the real tokens only) under `aot_eager`,
    which runs the same aten ops: only the GEMM's summation order over H may differ (MKL picks its
    kernel by row count), so a logit moves by at most ~H u of its O(1) magnitude (u = 2^-24), and
    the log-softmax (a max, a log-sum-exp) passes at most twice that on, scaled by |log p|."""
    return 2 * hidden * 2.0 ** -24 * max(1.0, float(logprobs.abs().max()))


def test_inference_forwards_share_one_graph_over_roles_and_shapes_and_equal_eager(monkeypatch):
    """The reference's and the policy's log-probs (and entropy) under `no_grad` (`rg.logprobs`) go
    through the compiled forward too: one graph a role over three shapes of `SHAPES` (Dynamo inlines
    the modules, their parameters are graph inputs; the reference is frozen, as the one role recipe
    builds every role without an optimizer, and a parameter's requires_grad is a guard: a graph of its
    own), then one more for the update's forward with gradients, and no recompile after. The LM head runs in the graph over every
    position (`all_positions_head`), so the values equal eager's within `head_bound`."""
    counter = _counting_compile(monkeypatch)
    executors = {compiled: tiny_executor(("policy", "ref")) for compiled in (False, True)}
    executors[True].compile_train = True
    graphs = []
    for k, (prompts, responses, width, steps) in enumerate(SHAPES[:3]):
        batch = ragged_rollouts(prompts, responses, width, steps, seed=k)
        for role in ("ref", "policy"):
            (eager, eager_entropy), (compiled, compiled_entropy) = (
                executors[c].logprobs(executors[c].current(role), batch, entropy=True) for c in (False, True))
            torch.testing.assert_close(compiled, eager, rtol=0, atol=head_bound(eager))
            # entropy = -sum p log p: a log-prob error d moves it by at most d (1 + entropy)
            torch.testing.assert_close(compiled_entropy, eager_entropy, rtol=0,
                                       atol=head_bound(eager) * (1 + float(eager_entropy.max())))
        graphs.append(counter.frame_count)
        for c in (False, True):
            Interpreter(executors[c]).run(clipped_surrogate.trace(), batch)
    torch._dynamo.reset()
    assert graphs == [2, 3, 3], f"graphs compiled before each shape's update: {graphs}"


def test_packed_inference_goes_through_the_compiled_forward(monkeypatch):
    """`rg.logprobs(micro_batch_tokens=...)` (packed forwards) is compiled as well and equals eager."""
    counter = _counting_compile(monkeypatch)
    executors = {compiled: tiny_executor(("policy",)) for compiled in (False, True)}
    executors[True].compile_train = True
    batch = ragged_rollouts(*SHAPES[0], seed=0)
    eager, compiled = (executors[c].logprobs(executors[c].current("policy"), batch, micro_batch_tokens=16)
                       for c in (False, True))
    torch._dynamo.reset()
    assert counter.frame_count >= 1
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_log_probs_equal_eager_within_fp32_reordering():
    """Inductor's no-grad forward of the reference against eager, one shape (one compile, ~20-60 s
    loaded). The matrix products stay BLAS calls on both sides; Inductor fuses and reorders the
    other reductions (RMSNorm's mean over H, the attention softmax). A reordered fp32 sum of k terms
    moves by at most ~k u of their magnitude (u = 2^-24): with k <= H = 64 over 2L + 1 = 5 normalised
    reductions on the way to logits of |log p| <= ~5, |diff| <= 64 x 5 x 6e-8 x 5 ~ 1e-4."""
    executors = {compiled: tiny_executor(("policy", "ref")) for compiled in (False, True)}
    executors[True].compile_train = True
    batch = ragged_rollouts(*SHAPES[0], seed=0)
    eager, compiled = (executors[c].logprobs(executors[c].current("ref"), batch) for c in (False, True))
    bound = 64 * 5 * 2.0 ** -24 * max(1.0, float(eager.abs().max()))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=bound)


@pytest.mark.parametrize("seed", range(6))
def test_the_all_positions_head_equals_the_chunked_head_values_and_gradients(seed):
    """`all_positions_head` (the compiled forward's head) against `masked_head` (eager's chunked
    head) on random states, ragged masks and temperatures, eager, so any difference is the GEMM's
    row-count-dependent summation order (`head_bound`) and, for the gradients, autograd's backward
    against the chunked head's hand-written one: the same terms g (onehot - p) - g_ent p (log p + H)
    summed in another order over V = 47 and over the N T positions, each within k u of the sum of
    |terms|, bounded here by 8 u (V + N T) x max(1, |grad|)."""
    from rlgraph.backends.local.logprobs import all_positions_head, masked_head

    generator = torch.Generator().manual_seed(seed)
    rows, steps, hidden, vocab = 1 + seed, 3 + 2 * seed, 64, 47
    states = torch.randn(rows, steps, hidden, generator=generator, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, hidden, generator=generator)).requires_grad_()
    targets = torch.randint(0, vocab, (rows, steps), generator=generator)
    mask = torch.rand(rows, steps, generator=generator) < 0.7
    temperature = (1.0, 0.7, 1.3)[seed % 3]
    runs = []
    for head in (masked_head, all_positions_head):
        lp, entropy = head(states, weight, targets, mask, temperature=temperature, with_entropy=True)  # [N, T]
        (lp.sum() + 0.1 * entropy.sum()).backward()
        runs.append((lp.detach(), entropy.detach(), states.grad.clone(), weight.grad.clone()))
        states.grad, weight.grad = None, None
    (lp, entropy, grad_h, grad_w), (lp2, entropy2, grad_h2, grad_w2) = runs
    assert torch.equal(lp2[~mask], torch.zeros_like(lp2[~mask])) and torch.equal(entropy2[~mask], entropy[~mask])
    torch.testing.assert_close(lp2, lp, rtol=0, atol=head_bound(lp))
    torch.testing.assert_close(entropy2, entropy, rtol=0, atol=head_bound(lp) * (1 + float(entropy.max())))
    for mine, theirs in ((grad_h2, grad_h), (grad_w2, grad_w)):
        bound = 8 * 2.0 ** -24 * (vocab + rows * steps) * max(1.0, float(theirs.abs().max()))
        torch.testing.assert_close(mine, theirs, rtol=0, atol=bound)


def test_the_head_runs_in_the_graph_only_where_its_logits_fit_one_block():
    """`head_fits_one_block`: N T V <= 2^22 f32 logits (the chunked head's block floor)."""
    from rlgraph.backends.local.logprobs import head_fits_one_block
    from rlgraph.kernels.logprob_head import BLOCK_FLOOR_ELEMENTS

    model = tiny_executor(("policy",)).models["policy"].model
    vocab = model.get_output_embeddings().weight.shape[0]
    fitting = BLOCK_FLOOR_ELEMENTS // vocab  # positions
    assert head_fits_one_block(model, 1, fitting) and head_fits_one_block(model, fitting, 1)
    assert not head_fits_one_block(model, 1, fitting + 1) and not head_fits_one_block(model, fitting + 1, 1)
