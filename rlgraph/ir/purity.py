"""Refusals of what a traced program cannot mean: in-place changes and Python/numpy conversions.

A traced program is pure: every value is computed once from its inputs. An in-place change
(`r.mul_(0)`, `adv += 1`, `x[0] = 1`, `out=`, `inplace=True`) would either be recorded as a
new value that other readers of the old one never see, or vanish; so it is refused at the
user's line with the out-of-place form to write instead. Converting a traced value into Python
or numpy (`np.asarray(r)`, `torch.tensor(r)`, `len(r)`) asks for data that does not exist while
tracing, and is refused the same way.

`refuse_inplace_node` runs on every recorded call; `install_refusals` adds the operator hooks
(`__iadd__`, `__setitem__`, `__array__`, ...) to the traced value class.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from rlgraph.errors import TraceError, user_location

# augmented assignment hooks -> the operator to write instead
_AUGMENTED = {"__iadd__": "+", "__isub__": "-", "__imul__": "*", "__itruediv__": "/", "__ifloordiv__": "//",
              "__imod__": "%", "__ipow__": "**", "__imatmul__": "@", "__iand__": "&", "__ior__": "|",
              "__ixor__": "^", "__ilshift__": "<<", "__irshift__": ">>"}

_PURE = "a traced program is pure: each value is computed once, and an in-place change would be invisible to " \
        "the code that already read the old value"


def inplace_error(what: str, fix: str) -> TraceError:
    return TraceError(f"in-place {what} on a traced value: {_PURE}", user_location(), fix=fix)


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def refuse_inplace_node(kind: str, target: Any, kwargs: dict) -> None:
    """Raise when the call about to be recorded changes one of its inputs in place.

    In-place torch methods and functions end with one underscore (`mul_`, `torch.relu_`); dunder
    names (`__add__`) are not in place.
    """
    name = _name(target)
    if kind in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__"):
        pure = name[:-1]
        example = f"x = x.{pure}(...)" if kind == "call_method" else f"x = torch.{pure}(x, ...)"
        raise inplace_error(f"`{'.' if kind == 'call_method' else ''}{name}()`",
                            f"write the out-of-place form and use its result: {example}")
    if kwargs.get("out") is not None:
        raise inplace_error(f"`{name}(..., out=...)`", f"drop out= and keep the result: y = {name}(...)")
    if kwargs.get("inplace") is True:
        raise inplace_error(f"`{name}(..., inplace=True)`", "pass inplace=False (the default) and use the result")


def _augmented(symbol: str):
    def refuse(self: Any, other: Any) -> Any:
        raise inplace_error(f"`{symbol}=`", f"rebind the name to a new value: x = x {symbol} other")

    return refuse


def _setitem(self: Any, index: Any, value: Any) -> None:
    raise inplace_error("item assignment `x[...] = ...`",
                        "build a new tensor instead: x = torch.where(mask, value, x), or torch.cat the parts")


def python_value_error(what: str) -> TraceError:
    return TraceError(
        f"{what} asks for the Python value of a traced value, which does not exist while the algorithm is "
        "traced (the program is built once and run on many batches)", user_location(),
        fix="keep it a tensor: return x.mean() as a metric rather than x.mean().item(), and do the math in torch",
    )


def _array(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise python_value_error("converting to a numpy array (np.asarray, np.array, .numpy())")


def _len(self: Any) -> int:
    raise python_value_error("len() or torch.tensor()/torch.as_tensor() of a traced value")


def install_refusals(cls: type[fx.Proxy]) -> None:
    """Give the traced value class the hooks that refuse in-place operators and conversions."""
    for hook, symbol in _AUGMENTED.items():
        setattr(cls, hook, _augmented(symbol))
    cls.__setitem__ = _setitem
    cls.__array__ = _array
    cls.__len__ = _len
