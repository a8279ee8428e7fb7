"""Group advantage estimators and policy losses by name, for configs, algorithms and the CLI.

Every entry is called one way, whatever the op underneath takes:

    adv = F.get_estimator("rloo")(rewards, group, n=n, mask=mask)          # f32[N] -> f32[N]
    loss, *metrics = F.get_loss("gspo")(lp, old_lp, adv, mask, **hparams)  # f32[] first, then metrics

- an estimator gets `rewards f32[N]`, `group i64[N]`, the group size `n` and the response
  `mask bool[N,T]` (None is fine for estimators that do not read it); the entry passes its op only
  what that op takes, so a traced program records the op itself (`group_normalize b c`) and the
  `fuse` pass still finds its kernel. Extra keywords are the estimator's hyper-parameters.
- a policy loss gets `(lp, old_lp, adv, mask, **hparams)` and returns a tuple whose first item is
  the loss; `entry.metrics` names the items after it.

Built-ins register where they are defined (`advantages.py`, `losses.py`); `@F.estimator` registers
the user's. An unknown name raises `UnknownNameError` naming the close matches and the registered
names. `rlgraph list` prints both registries.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import attrs
from torch import Tensor

from rlgraph.errors import TraceError, user_location

ROW_ARGUMENTS = ("mask",)  # the per-row tensors a call by name can supply, besides rewards and group


class UnknownNameError(TraceError, KeyError):
    """A name that no entry of a registry has; points at the caller's line (an algorithm's, when tracing)."""

    __str__ = Exception.__str__  # KeyError would print the repr of the message


def summary(doc: str | None) -> str:
    """The first paragraph of a docstring on one line ('' for none): what `rlgraph list` prints."""
    paragraph = inspect.cleandoc(doc or "").split("\n\n")[0]
    return " ".join(paragraph.split())


def same_definition(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """True for one function, or two defined at the same place (a re-run cell or module).

    `@F.estimator` ops compare by the per-group function they were made from.
    """
    a, b = (getattr(fn, "per_group", fn) for fn in (a, b))
    where = [(getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) for fn in (a, b)]
    return a is b or where[0] == where[1]


@attrs.frozen
class GroupEstimator:
    """A registered group advantage estimator: `entry(rewards, group, *, n, mask=None, **hparams) -> f32[N]`.

    `rows` are the per-row tensors `op` takes after `(rewards, group)` (at most `mask`), `takes_n`
    whether it takes the group size, `hparams` the fixed hyper-parameters of this name (Dr.GRPO is
    `group_normalize` with `scale=False`).
    """

    name: str
    op: Callable[..., Tensor]
    rows: tuple[str, ...] = ()
    takes_n: bool = False
    hparams: Mapping[str, Any] = attrs.field(factory=dict)
    doc: str = ""

    @property
    def __name__(self) -> str:  # so tools that name callables (hypothesis, checkers) show the registered name
        return self.name

    @property
    def takes_mask(self) -> bool:
        return "mask" in self.rows

    def __call__(self, rewards: Tensor, group: Tensor, *, n: int, mask: Tensor | None = None, **hparams: Any) -> Tensor:
        unsupplied = [row for row in self.rows if row not in ROW_ARGUMENTS]
        if unsupplied:
            raise TraceError(f"estimator {self.name!r} takes the per-row argument {unsupplied[0]!r}, which a call by "
                             "name cannot supply (it passes rewards, group, n and mask)", user_location(),
                             fix=f"take the mask as `mask` and compute from it, or call {self.name} directly")
        if self.takes_mask and mask is None:
            raise ValueError(f"estimator {self.name!r} reads the response lengths: pass mask=bool[N,T] (ro.mask)")
        keywords = {"n": n} if self.takes_n else {}
        return self.op(rewards, group, *([mask] if self.takes_mask else []), **keywords, **self.hparams, **hparams)


@attrs.frozen
class PolicyLoss:
    """A registered policy loss: `entry(lp, old_lp, adv, mask, **hparams) -> (loss, *metrics)`, all f32[]."""

    name: str
    op: Callable[..., tuple[Tensor, ...]]
    metrics: tuple[str, ...] = ("clip_frac", "approx_kl")
    doc: str = ""

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, **hparams: Any) -> tuple[Tensor, ...]:
        return self.op(lp, old_lp, adv, mask, **hparams)

    def supported(self, **hparams: Any) -> dict[str, Any]:
        """The items of `hparams` this loss takes, e.g. `supported(clip_low=0.2)` is {} for `gpg_loss`."""
        params = inspect.signature(self.op).parameters
        return {key: value for key, value in hparams.items() if key in params}


Entry = TypeVar("Entry", GroupEstimator, PolicyLoss)


class Registry(Mapping[str, Entry], Generic[Entry]):
    """Name -> entry; read like a dict, written with `register`, looked up with `lookup` (did-you-mean errors)."""

    def __init__(self, kind: str, how_to_add: str):
        self.kind = kind
        self.how_to_add = how_to_add
        self._entries: dict[str, Entry] = {}

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<{self.kind} registry: {', '.join(self)}>"

    def register(self, entry: Entry) -> Entry:
        """Add `entry`; re-registering the same definition (a re-run cell or module) replaces it."""
        old = self._entries.get(entry.name)
        if old is not None and not same_definition(old.op, entry.op):
            raise ValueError(f"a {self.kind} named {entry.name!r} is already registered "
                             f"({old.op.__module__}.{old.op.__qualname__}); pick another name")
        self._entries[entry.name] = entry
        return entry

    def lookup(self, name: str) -> Entry:
        """The entry called `name`; otherwise an `UnknownNameError` that lists the registered names."""
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        close = difflib.get_close_matches(name, list(self), n=1) if isinstance(name, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownNameError(
            f"{self.kind}={name!r} is not a registered {self.kind}{hint}", user_location(),
            fix=f"use one of {', '.join(self) or 'none'} (`rlgraph list`), or {self.how_to_add}",
        )


ESTIMATORS: Registry[GroupEstimator] = Registry(
    "estimator", "write one with @F.estimator (from the command line: `rlgraph ... --import your_module`)")
LOSSES: Registry[PolicyLoss] = Registry(
    "loss", "add one with F.register_loss(name, fn) (from the command line: `rlgraph ... --import your_module`)")


def _calling_convention(op: Callable[..., Any]) -> tuple[tuple[str, ...], bool]:
    """(per-row arguments after rewards and group, takes `n`) read from the op's signature.

    An `@F.estimator` op declares its per-row arguments on its per-group function (after `r`).
    """
    per_group = getattr(op, "per_group", None)
    if per_group is not None:
        return _positional_names(per_group)[1:], True
    return _positional_names(op)[2:], "n" in inspect.signature(op).parameters


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)


def register_estimator(name: str, op: Callable[..., Tensor], *, hparams: Mapping[str, Any] | None = None,
                       doc: str | None = None) -> GroupEstimator:
    """Make the group estimator `op(rewards, group, [mask], [n=], **hparams) -> f32[N]` callable by `name`.

    Which of `mask` and `n` to pass is read from `op`'s signature; `hparams` are fixed for this
    name; `doc` (one line) defaults to the first line of `op`'s docstring. Returns the entry.
    """
    rows, takes_n = _calling_convention(op)
    entry = GroupEstimator(name, op, rows, takes_n, dict(hparams or {}), doc or summary(op.__doc__))
    return ESTIMATORS.register(entry)


def get_estimator(name: str) -> GroupEstimator:
    """The estimator registered as `name`, called `est(rewards, group, n=n, mask=mask)`; see the module doc."""
    return ESTIMATORS.lookup(name)


def register_loss(name: str, op: Callable[..., tuple[Tensor, ...]], *,
                  metrics: tuple[str, ...] = ("clip_frac", "approx_kl"), doc: str | None = None) -> PolicyLoss:
    """Make the policy loss `op(lp, old_lp, adv, mask, **hparams) -> (loss, *metrics)` callable by `name`.

    `metrics` names the scalars after the loss, in order. Returns the entry.
    """
    return LOSSES.register(PolicyLoss(name, op, tuple(metrics), doc or summary(op.__doc__)))


def get_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`, called `loss(lp, old_lp, adv, mask, **hparams)`; see the module doc."""
    return LOSSES.lookup(name)
