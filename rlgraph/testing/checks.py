"""Property checkers a researcher calls in one line from their own test suite.

    from rlgraph import testing as rgt

    rgt.assert_microbatch_invariant(lambda b: my_loss(b.logprobs, b.old_logprobs, b.advantages, b.mask))
    rgt.assert_padding_invariant(lambda b: my_estimator(b.rewards, b.group, b.mask))
    rgt.assert_group_permutation_equivariant(lambda b: my_estimator(b.rewards, b.group, b.mask))
    rgt.assert_finite(...), rgt.assert_singleton_groups_zero(...)   # the estimator conventions
    rgt.assert_plan_invariants(rg.compile(my_algo, mesh="gpu:8", placement=rg.split({...})))
    rgt.assert_compiled_matches_eager(my_algo, executor=rgt.tiny_executor, batches=[...], n=4)

Each property checker runs hypothesis itself (under the loaded settings profile, see
`rlgraph.testing.profiles`) and, on failure, raises `PropertyFailure` whose message ends with the
shrunk counterexample as Python to paste into a test; `failure.counterexample` holds it as data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings as Settings, strategies as st

from rlgraph.functional.aggregate import global_counts, loss_normalization
from rlgraph.testing.batch import FIELDS, RolloutBatch
from rlgraph.testing.counterexample import Counterexample, PropertyFailure, fail, reading
from rlgraph.testing.strategies import group_permutations, micro_batch_splits, padding_of, rollout_batches

BatchFn = Callable[[RolloutBatch], Any]


# -- running a property under hypothesis ---------------------------------------------------------


def run_property(prop: Callable[..., None], settings: Settings | None) -> None:
    """Run a `@given` property under the loaded profile (or `settings`), one bug reported."""
    base = settings or Settings()
    Settings(base, report_multiple_bugs=False, deadline=None,
             suppress_health_check=[*base.suppress_health_check, HealthCheck.too_slow,
                                    HealthCheck.data_too_large])(prop)()


def _leaves(value: Any, prefix: str = "out") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a function's result, with a path name: `out[0]`, `out["clip_frac"]`."""
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, Mapping):
        return [leaf for key, v in value.items() for leaf in _leaves(v, f"{prefix}[{key!r}]")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{prefix}[{i}]")]
    if isinstance(value, (int, float)):
        return [(prefix, torch.tensor(float(value)))]
    raise TypeError(f"the checked function returned {type(value).__name__} at {prefix}; return tensors, "
                    "tuples/lists of tensors or a dict of tensors")


def _call(fn: BatchFn, batch: RolloutBatch, prop: str, details: dict[str, Any]) -> tuple[Any, set[str]]:
    """`fn(batch)`, recording the fields it reads; an exception becomes the counterexample."""
    proxy = reading(batch)
    try:
        return fn(proxy), proxy.fields_read
    except PropertyFailure:
        raise
    except Exception as exc:  # the user's function failed on a valid batch: that is the finding
        raise PropertyFailure(Counterexample(prop, _name(fn), batch, {**details, "raised": f"{type(exc).__name__}: {exc}"},
                                             f"{_name(fn)} raised {type(exc).__name__}: {exc}", tuple(proxy.fields_read))) from exc


def fields_read(fn: BatchFn) -> tuple[str, ...]:
    """The batch fields `fn` reads, found by calling it once on a small batch of zeros (all fields
    if that call fails: then every field is drawn and the failure shows up as a counterexample)."""
    probe = RolloutBatch.of(group=[0, 0, 1, 1], mask=[[True, True], [True, False], [True, True], [False, False]])
    proxy = reading(probe)
    try:
        with torch.no_grad():
            fn(proxy)
    except Exception:  # noqa: BLE001 - the property run reports it with a real batch
        return FIELDS
    return tuple(sorted(proxy.fields_read))


def _batches(fn: BatchFn, batches: st.SearchStrategy[RolloutBatch] | None) -> st.SearchStrategy[RolloutBatch]:
    return batches if batches is not None else rollout_batches(fields=fields_read(fn))


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _scale(batch: RolloutBatch, fields: set[str]) -> float:
    """The largest magnitude among the values `fn` read: float32 rounding grows with it (rewards
    of 1e4 summed in another order differ by ~1e-3), so tolerances scale with it."""
    values = [getattr(batch, name).detach().abs().max() for name in fields
              if name != "mask" and getattr(batch, name).is_floating_point() and getattr(batch, name).numel()]
    return max([1.0, *(float(v) for v in values if torch.isfinite(v))])


def _mismatch(expected: torch.Tensor, actual: torch.Tensor, rtol: float, atol: float,
              where: torch.Tensor | None = None) -> str | None:
    """None when close (NaN equal to NaN), else a short description of the worst difference."""
    if expected.shape != actual.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    expected, actual = expected.detach().double(), actual.detach().double()
    if where is not None:
        expected, actual = expected[where], actual[where]
    close = torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    index = int((~close).flatten().nonzero()[0])
    return f"{actual.flatten()[index].item()!r} != expected {expected.flatten()[index].item()!r}"


def _fail(prop: str, fn: Callable, batch: RolloutBatch, fields: set[str], message: str, **details: Any) -> None:
    fail(prop, _name(fn), message, batch=batch, fields=tuple(sorted(fields)), **details)


# -- micro-batch invariance -------------------------------------------------------------------------


def microbatch_losses(loss: BatchFn, batch: RolloutBatch, micro_batches: Sequence[Sequence[int]]) -> list[Any]:
    """`loss` on each micro-batch under the whole batch's global counts, as `rg.update` runs it."""
    tokens, sequences = global_counts(batch.mask)
    with loss_normalization(tokens, sequences, horizon=batch.T):
        return [loss(batch.select(rows)) for rows in micro_batches]


def _differentiable(batch: RolloutBatch) -> tuple[RolloutBatch, list[str]]:
    names = ["logprobs", "values"]
    return batch.replace(**{name: getattr(batch, name).detach().clone().requires_grad_(True) for name in names}), names


def _grads(total: torch.Tensor, batch: RolloutBatch, names: list[str]) -> list[torch.Tensor]:
    leaves = [getattr(batch, name) for name in names]
    if not total.requires_grad:
        return [torch.zeros_like(leaf) for leaf in leaves]
    grads = torch.autograd.grad(total, leaves, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]


def _check_split(loss: BatchFn, batch: RolloutBatch, names: list[str], full: Any, fields: set[str],
                 split: list[list[int]], rtol: float, atol: float) -> None:
    prop_name = "micro-batch invariance"
    details = {"micro_batches": split}
    parts = [_call(lambda b: microbatch_losses(loss, b, [rows])[0], batch, prop_name, details)[0] for rows in split]
    full_leaves = _leaves(full)
    summed = [sum(_leaves(part)[i][1] for part in parts) for i in range(len(full_leaves))]
    for (path, expected), actual in zip(full_leaves, summed):
        problem = _mismatch(expected, actual, rtol, atol)
        if problem:
            _fail(prop_name, loss, batch, fields, f"{path}: sum over micro-batches {problem} (the full batch)",
                  **details, full=float(expected.detach()), summed=float(actual.detach()))
    for name, want, got in zip(names, _grads(full_leaves[0][1], batch, names), _grads(summed[0], batch, names)):
        problem = _mismatch(want, got, rtol, atol)
        if problem:
            _fail(prop_name, loss, batch, fields, f"d loss / d {name}: micro-batch sum {problem} (the full batch)", **details)


def assert_microbatch_invariant(loss: BatchFn, *, batches: st.SearchStrategy[RolloutBatch] | None = None,
                                rtol: float = 1e-4, atol: float = 1e-5, settings: Settings | None = None) -> None:
    """The loss, its metrics and its gradients do not depend on how the batch is cut into micro-batches.

    `loss(batch)` returns a scalar, a tuple whose first item is the scalar loss, or `(loss,
    {metric: scalar})`. The full-batch value is `loss(batch)`; the micro-batch value is the sum of
    `loss(piece)` over a random partition of the rows, each run under `loss_normalization` with the
    whole batch's counts (what `rg.update` does across micro-batches and data-parallel ranks).
    """
    prop_name, strategy = "micro-batch invariance", _batches(loss, batches)

    @given(st.data())
    def prop(data: st.DataObject) -> None:
        batch = data.draw(strategy, label="batch")
        drawn = data.draw(micro_batch_splits(batch.N), label="micro_batches")
        batch, names = _differentiable(batch)
        full, fields = _call(loss, batch, prop_name, {"micro_batches": drawn})
        # One row per micro-batch first: the finest split shows most bugs and shrinks best.
        for split in ([[row] for row in range(batch.N)], drawn):
            _check_split(loss, batch, names, full, fields, split, rtol, atol)

    run_property(prop, settings)


# -- padding invariance -----------------------------------------------------------------------------


def _token_level(out: torch.Tensor, rows: int, length: int) -> bool:
    return out.dim() >= 2 and out.shape[0] == rows and out.shape[1] == length


def assert_padding_invariant(fn: BatchFn, *, batches: st.SearchStrategy[RolloutBatch] | None = None,
                             strict: bool = False, max_extra: int = 3, rtol: float = 1e-5, atol: float = 1e-6,
                             settings: Settings | None = None) -> None:
    """`fn` never reads padded positions: changing what they hold, or adding padding columns,
    leaves every output unchanged (token outputs are compared at unmasked positions).

    Padded positions get other plausible values (log-probs stay <= 0); `strict=True` fills them
    with NaN, which also rejects `x * mask` (NaN * 0 is NaN) in favour of `torch.where`.
    """
    prop_name = "padding invariance"
    strategy, read = _batches(fn, batches), fields_read(fn)

    @given(st.data())
    def prop(data: st.DataObject) -> None:
        batch = data.draw(strategy, label="batch")
        extra, fill = data.draw(padding_of(batch, max_extra=max_extra, fields=read), label="padding")
        padded = batch.padded(extra, float("nan") if strict else fill)
        details = {"extra_columns": extra, "padded": padded}
        expected, fields = _call(fn, batch, prop_name, details)
        actual, more = _call(fn, padded, prop_name, details)
        for (path, want), (_, got) in zip(_leaves(expected), _leaves(actual)):
            where = None
            if _token_level(want, batch.N, batch.T) and _token_level(got, batch.N, padded.T):
                got, where = got[:, :batch.T], batch.mask.reshape(batch.mask.shape + (1,) * (want.dim() - 2)).expand_as(want)
            problem = _mismatch(want, got, rtol, atol + rtol * _scale(batch, fields), where)
            if problem:
                _fail(prop_name, fn, batch, fields | more,
                      f"{path} changes when padded positions change ({extra} extra column(s)): {problem}", **details)

    run_property(prop, settings)


# -- group-permutation equivariance ----------------------------------------------------------------


def assert_group_permutation_equivariant(fn: BatchFn, *, batches: st.SearchStrategy[RolloutBatch] | None = None,
                                         contiguous: bool = True, rtol: float = 1e-5, atol: float = 1e-6,
                                         settings: Settings | None = None) -> None:
    """Reordering groups, reordering rows within a group and renaming group ids permutes the
    per-row outputs the same way and leaves every other output unchanged.

    `contiguous=False` shuffles rows freely (for estimators that only read `group`, not the layout).
    """
    prop_name = "group-permutation equivariance"
    strategy = _batches(fn, batches)

    @given(st.data())
    def prop(data: st.DataObject) -> None:
        batch = data.draw(strategy, label="batch")
        rows, labels = data.draw(group_permutations(batch, contiguous=contiguous), label="permutation")
        permuted = batch.select(rows).relabel(labels)
        details = {"rows": rows, "labels": labels}
        expected, fields = _call(fn, batch, prop_name, details)
        actual, more = _call(fn, permuted, prop_name, details)
        for (path, want), (_, got) in zip(_leaves(expected), _leaves(actual)):
            if want.dim() >= 1 and want.shape[0] == batch.N:
                want = want[torch.tensor(rows, dtype=torch.long)]
            problem = _mismatch(want, got, rtol, atol + rtol * _scale(batch, fields))
            if problem:
                _fail(prop_name, fn, batch, fields | more, f"{path} is not permuted with the rows: {problem}", **details)

    run_property(prop, settings)


# -- the estimator conventions of docs/functional.md: finite results, singleton groups give 0 --------


def assert_finite(fn: BatchFn, *, batches: st.SearchStrategy[RolloutBatch] | None = None,
                  settings: Settings | None = None) -> None:
    """Every output is finite (no NaN, no inf) on finite batches: ties, extremes, singleton groups
    and empty rows included. A NaN advantage trains every weight into NaN at the next step."""
    prop_name, strategy = "finiteness", _batches(fn, batches)

    @given(st.data())
    def prop(data: st.DataObject) -> None:
        batch = data.draw(strategy, label="batch")
        out, fields = _call(fn, batch, prop_name, {})
        for path, value in _leaves(out):
            bad = ~torch.isfinite(value.detach())
            if bool(bad.any()):
                index = tuple(int(i) for i in bad.nonzero()[0]) if value.dim() else ()
                _fail(prop_name, fn, batch, fields, f"{path}{list(index) if index else ''} is "
                      f"{value.detach()[index].item()!r}", output=path, index=list(index))

    run_property(prop, settings)


def assert_singleton_groups_zero(fn: BatchFn, *, batches: st.SearchStrategy[RolloutBatch] | None = None,
                                 atol: float = 1e-6, settings: Settings | None = None) -> None:
    """A group of one sample has nothing to be compared with: every per-row output is 0 when each
    row is its own group (rlgraph's convention; verl passes the raw reward through instead)."""
    prop_name, strategy = "singleton groups give 0", _batches(fn, batches)

    @given(st.data())
    def prop(data: st.DataObject) -> None:
        drawn = data.draw(strategy, label="batch")
        batch = drawn.replace(group=torch.arange(drawn.N))  # every row alone in its group
        out, fields = _call(fn, batch, prop_name, {})
        for path, value in _leaves(out):
            if value.dim() >= 1 and value.shape[0] == batch.N:
                problem = _mismatch(torch.zeros_like(value), value, 0.0, atol)
                if problem:
                    _fail(prop_name, fn, batch, fields, f"{path} of a singleton group: {problem}", output=path)

    run_property(prop, settings)


def check_loss(loss: BatchFn, **kwargs: Any) -> None:
    """Micro-batch invariance and padding invariance of a loss."""
    assert_microbatch_invariant(loss, **kwargs)
    assert_padding_invariant(loss, **{k: v for k, v in kwargs.items() if k in ("batches", "settings")})


def check_estimator(estimator: BatchFn | str, **kwargs: Any) -> None:
    """Padding invariance, group-permutation equivariance, finiteness and singleton groups giving 0
    of an advantage estimator.

    `estimator` is a function of a `RolloutBatch`, or a registered estimator (its name, e.g.
    "rloo", or an `@F.estimator` op), called as `F.get_estimator(name)(b.rewards, b.group, n=b.n,
    mask=b.mask)` on equal-size groups.
    """
    if isinstance(estimator, str) or hasattr(estimator, "per_group"):
        from rlgraph.functional.registry import get_estimator

        name = estimator if isinstance(estimator, str) else estimator.__name__
        entry = get_estimator(name)  # the registry's one calling convention

        def estimator(b: RolloutBatch) -> torch.Tensor:
            return entry(b.rewards, b.group, n=b.n, mask=b.mask)

        estimator.__qualname__ = name
    assert_padding_invariant(estimator, **kwargs)
    assert_group_permutation_equivariant(estimator, **kwargs)
    common = {key: value for key, value in kwargs.items() if key in ("batches", "settings")}
    assert_finite(estimator, **common)
    assert_singleton_groups_zero(estimator, **common)


__all__ = ["FIELDS", "assert_finite", "assert_group_permutation_equivariant", "assert_microbatch_invariant",
           "assert_padding_invariant", "assert_singleton_groups_zero", "check_estimator", "check_loss", "microbatch_losses"]
