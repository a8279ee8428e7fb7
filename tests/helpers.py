"""Shared fixtures-as-functions: a tiny seeded policy, the arithmetic task, an executor."""

import math

import torch

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.models import load_tokenizer
from rlgraph.data import arithmetic
from rlgraph.rewards import exact_match
from rlgraph.testing.tiny import length_parity_reward, tiny_executor, tiny_prompts

TOKENIZER = load_tokenizer()
SPLITS = arithmetic.make_splits(seed=0)


def make_executor(seed: int = 0, lr: float = 1e-3, with_ref: bool = False, max_new_tokens: int = 5,
                  reward=exact_match, critic: bool = False, critic_lr: float = 1e-3) -> LocalExecutor:
    """Policy with AdamW (and optionally a frozen ref and a trainable critic): `rgt.tiny_executor`."""
    roles = ("policy",) + (("ref",) if with_ref else ()) + (("critic",) if critic else ())
    return tiny_executor(roles, seed=seed, lr=lr, optimizer="adamw", critic_lr=critic_lr, reward=reward,
                         max_new_tokens=max_new_tokens)


def prompts(count: int = 4, offset: int = 0):
    return tiny_prompts(count, offset)


def demonstrations(count: int = 16, offset: int = 0):
    return arithmetic.to_demonstrations(SPLITS.train[offset:offset + count], TOKENIZER)


def params_of(executor: LocalExecutor, role: str = "policy") -> list[torch.Tensor]:
    return [p.detach().clone() for p in executor.models[role].model.parameters()]


parity_reward = length_parity_reward  # varies on an untrained model (exact match is all zeros there)


def prompt_source(count: int = 4, offset: int = 100):
    """A fake prompt source for refill loops: successive train batches of `count` from `offset`."""
    drawn = [offset]

    def more():
        drawn[0] += count
        return prompts(count, offset=drawn[0] - count)

    return more


def assert_spmd_resume_is_exact(compiled, world, path, batch, uninterrupted, final) -> None:
    """A checkpoint at `path` resumed on fresh spmd workers gives step `batch` the metrics
    `uninterrupted` and the policy weights `final` of the run that was never stopped, exactly."""
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.runtime.spmd import SpmdTransport
    from rlgraph.train.checkpoint import load_checkpoint

    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        resumed = PlanRunner(compiled, transport, controller=world.controller())
        load_checkpoint(path, resumed)
        assert resumed.run(batch)[1] == uninterrupted
        resumed_state = transport.pull_state("policy")
        assert all(torch.equal(resumed_state[name], value) for name, value in final.items())


# -- comparing two runtimes ----------------------------------------------------------------------
# Two runtimes (local, spmd, ray) run the same fp32 arithmetic in other orders: a rank sums its half
# of the batch, then the halves are added; matmuls over half the rows may block differently. Higham
# ("Accuracy and Stability of Numerical Algorithms", 2002, sec. 3.1 and 4.2): a sum of K terms in any
# order is within gamma_K ~ K*u of the exact one, relative to the sum of the terms' magnitudes, so two
# orders differ by at most 2*K*u of it. Errors along a chain of sums add (to first order), so K is the
# length of the longest chain of additions behind one value. The bounds below are these worst cases.
U = 2.0 ** -24  # fp32 unit roundoff: one rounding moves a value by at most U relative


def reduction_terms(hidden: int = 64, intermediate: int = 256, layers: int = 2, vocab: int = 47,
                    positions: int = 64, tokens: int = 1024) -> int:
    """Additions along the longest chain behind a loss of the tiny Qwen2 (`rlgraph/assets/tiny_qwen2.json`):
    per layer two RMSNorm means (2h), the q/k/v and o projections (2h), scores and their softmax sum and
    A@V (over at most `positions`, 2x), the MLP's gate/up (h) and down (I) projections, a margin of h;
    then the final norm and the head (2h), the log-sum-exp over V and the mean over at most `tokens`."""
    return layers * (6 * hidden + intermediate + 2 * positions) + 2 * hidden + vocab + tokens


# 2*K*u = 3.3e-4 for the tiny model: the tolerance, relative to the magnitudes summed, of any value two runtimes
# compute. A wrong gradient scale (2x) or a missing all-reduce moves `grad_norm` and the next loss by tens of
# percent: 1000x this.
RTOL = 2 * reduction_terms() * U
# Metrics that sum signed terms of size ~1 (surrogate losses over unit-std advantages, log-prob differences) can
# cancel to ~0, so their bound is RTOL absolute. The others sum non-negative terms (rewards, k3 KL estimates, norms,
# lengths, entropies): RTOL relative, plus each term's own few roundings (exp, subtract, divide: ~U each, both
# sides, so 16 U) for values near 0.
SIGNED_METRICS = ("loss", "logprob_diff", "approx_kl", "ref_kl")  # ref_kl: PPO's k1, log p - log ref


def assert_same_metrics(expected: dict[str, float], got: dict[str, float], keys=None) -> None:
    """The metrics of one step on two runtimes: equal keys (unless `keys` picks some), values within
    the bounds above. After an AdamW step the runtimes' weights can differ by up to lr on elements
    whose gradient was rounding noise (see `assert_same_training`); a loss moves by gradient x that
    difference, and those gradients are ~0: the first-order change vanishes, so later steps keep the bound."""
    if keys is None:
        assert expected.keys() == got.keys()
    for key in keys or expected:
        if key.startswith("time/"):  # wall-clock, as rlgraph.testing's comparisons skip it
            continue
        floor = RTOL if any(part in key for part in SIGNED_METRICS) else 16 * U
        assert math.isclose(expected[key], got[key], rel_tol=RTOL, abs_tol=floor), (key, expected[key], got[key])


def adam_step_bound(step: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat / sqrt(v_hat)| after `step` AdamW steps, for any gradients. With
    m = (1-b1) sum b1^(t-i) g_i and v = (1-b2) sum b2^(t-i) g_i^2, Cauchy-Schwarz on
    sum (b1/sqrt(b2))^(t-i) * (sqrt(b2)^(t-i) |g_i|) gives |m|/sqrt(v) <= (1-b1)/sqrt(1-b2) *
    sqrt(sum (b1^2/b2)^k); the bias corrections multiply by sqrt(1-b2^t)/(1-b1^t). (1.0 at step 1.)"""
    ratio = sum((beta1 ** 2 / beta2) ** k for k in range(step))
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(ratio) * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)


def state_of(worker) -> dict[str, torch.Tensor]:
    """A copy of a local worker's weights, to compare updates against."""
    return {name: value.detach().clone() for name, value in worker.model.state_dict().items()}


def assert_same_training(worker, got: dict[str, torch.Tensor], before: dict[str, torch.Tensor] | None, *, steps: int,
                         trainable_only: bool = False) -> None:
    """The weights `got` (another runtime's state dict) against the local `worker` after the same
    `steps` optimizer steps from `before`, within what rounding can explain (the optimizer's kind and
    hyperparameters are read from `worker.optimizer`; `before` may be None for AdamW, and
    `trainable_only` compares a LoRA checkpoint's adapters):

    - frozen tensors (no gradient, e.g. a LoRA base) are bit-identical: nothing touches them;
    - SGD (no momentum, no weight decay): theta - lr * g is linear in the gradient, whose rounding is
      at most RTOL of the scale of its terms; the tensor's largest update per step stands for that
      scale. Each runtime also rounds the new theta (U |theta| a rounding);
    - AdamW: the step lr * m_hat / (sqrt(v_hat) + eps) normalises the gradient, so rounding noise
      eta in a gradient element moves the step by about lr * 2 * eta / sqrt(v_hat) (the m and the v
      path, each <= eta / sqrt(v_hat)): tight where the element's gradient is large, up to the whole
      step where it is ~eta (it may flip sign: at most 2 * lr * `adam_step_bound` a step, which weight
      decay, a contraction, does not grow). eta is RTOL of the tensor's largest gradient, which
      sqrt(v_hat) of the local optimizer state gives; the final v_hat stands for every step's (the
      runs compared take 1-4 steps on gradients of one scale). Not covered: a later gradient moved
      by an earlier noisy step (Hessian x a difference of up to lr on elements with ~0 gradient).
    """
    optimizer = worker.optimizer
    # By storage, not by name: a tied head (`lm_head.weight`) is the embedding's parameter under a second name.
    params = {param.data_ptr(): param for param in worker.model.parameters() if param.requires_grad}
    full = worker.model.state_dict()
    by_name = {name: params[value.data_ptr()] for name, value in full.items() if value.data_ptr() in params}
    state = {name: value for name, value in full.items() if name in by_name or not trainable_only}
    assert state.keys() == got.keys()
    for name, value in state.items():
        if name not in by_name:
            assert torch.equal(got[name], value), name
            continue
        ulps = 4 * steps * U * float(value.abs().max())  # each side rounds twice a step (decay, step): U |theta| each
        if isinstance(optimizer, torch.optim.AdamW) and by_name[name] not in optimizer.state:  # never had a gradient
            assert torch.equal(got[name], value) and (before is None or torch.equal(value, before[name])), name
            continue
        if isinstance(optimizer, torch.optim.AdamW):
            tol = _adam_tolerance(optimizer, by_name[name], steps) + ulps
        else:
            assert isinstance(optimizer, torch.optim.SGD) and not optimizer.defaults["momentum"], optimizer
            tol = steps * RTOL * float((value - before[name]).abs().max()) + ulps
        diff = (got[name] - value).abs()
        assert bool((diff <= tol).all()), (name, float((diff - tol).max()), float(diff.max()))


def _adam_tolerance(optimizer: torch.optim.AdamW, param: torch.Tensor, steps: int) -> torch.Tensor:
    """Per element: the most rounding noise in the gradient can move `param` over `steps` AdamW steps."""
    group = next(group for group in optimizer.param_groups if any(p is param for p in group["params"]))
    (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
    slot = optimizer.state[param]
    t = int(slot["step"])
    scale = (slot["exp_avg_sq"] / (1 - beta2 ** t)).sqrt()          # sqrt(v_hat): the gradient's size, per element
    eta = RTOL * float(scale.max())                                   # rounding noise of any of the tensor's gradients
    cap = sum(2 * lr * adam_step_bound(k, beta1, beta2) for k in range(t - steps + 1, t + 1))
    return torch.clamp(steps * lr * 2 * eta / (scale + eps), max=cap)


class _Worker:
    """A model and its optimizer, the shape `assert_same_training` reads."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer


def checkpoint_worker(run_dir, *, lr: float):
    """The policy of `rlgraph train`'s run `run_dir` at its latest checkpoint, with its optimizer
    state, as a worker for `assert_same_training`; `lr`: the largest learning rate its steps used."""
    from rlgraph.train.checkpoint import latest_checkpoint, read_checkpoint
    from rlgraph.train.roles import checkpoint_policy
    from rlgraph.train.run import load_run_config
    from rlgraph.train.setup import _tokenizer

    config = load_run_config(run_dir)
    path = latest_checkpoint(run_dir)
    model, _ = checkpoint_policy(config, _tokenizer(config), path)
    role = read_checkpoint(path)[0].roles["policy"]
    assert role.optimizer_kind == "AdamW", role.optimizer_kind  # the runs under test; SGD has no state to read
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)  # the executor's order
    optimizer.load_state_dict(role.optimizer)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return _Worker(model, optimizer)


def assert_rows_close(rows: list[dict], expected: list[dict], keys=None) -> None:
    """Step by step, `keys` (default: every key, which must be the same) agree within `RTOL`."""
    for row, want in zip(rows, expected, strict=True):
        assert_same_metrics(want, row, keys)
