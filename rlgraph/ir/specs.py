"""Specs: the static type of every value in a program.

A tensor spec is a shape of symbolic dims (`N`, `T`, ...) or ints, a dtype and an optional layout;
records (`Prompts`, `Rollouts`), model versions (`policy@v+1`) and reward functions have specs of
their own. Specs are frozen attrs classes and print the way the program printer shows them:
`f32[N,T]`, `Rollouts[N,T]`, `policy@v+1`.

Shape inference runs torch ops on meta tensors whose sizes *witness* the symbolic dims: each atom
gets a distinct prime size (N gets B*n), so a size in an op's result maps back to a dim, and a
mismatch such as `[N,T] + [N,P]` fails exactly as it would on real data.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import attrs
import torch


@attrs.frozen
class Dim:
    """A symbolic dimension, e.g. `N` (rollouts) or `T` (response tokens)."""

    name: str

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return self.name


B, n, N, T, P, V, H = (Dim(name) for name in ("B", "n", "N", "T", "P", "V", "H"))
DIM_MEANINGS = {
    "B": "prompts in a batch", "n": "samples per prompt (group size)", "N": "rollouts, B*n",
    "T": "response tokens", "P": "prompt tokens", "V": "vocabulary", "H": "hidden size",
}
WITNESS: dict[Dim, int] = {B: 5, n: 7, N: 35, T: 11, P: 13, V: 23, H: 29}
_ATOMS = (n, B, N, T, P, V, H)

Size = Dim | int


def _build_size_names() -> dict[int, Size]:
    names: dict[int, Size] = {size: dim for dim, size in WITNESS.items()}
    for left, right in itertools.combinations(_ATOMS, 2):
        product = WITNESS[left] * WITNESS[right]
        names.setdefault(product, Dim(f"{left}*{right}"))
    names.pop(1, None)
    return names


_SIZE_NAMES = _build_size_names()


def witness_size(size: Size) -> int:
    if isinstance(size, int):
        return size
    if size in WITNESS:
        return WITNESS[size]
    left, _, right = size.name.partition("*")
    return WITNESS[Dim(left)] * WITNESS[Dim(right)]


def symbolic_size(size: int) -> Size:
    return _SIZE_NAMES.get(size, size)


DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool",
}


@attrs.frozen
class Layout:
    """Where a value lives: on the controller, replicated on a role's ranks, or sharded along a dim."""

    kind: str = "controller"  # controller | replicated | sharded
    role: str | None = None
    dim: int | None = None

    def __str__(self) -> str:
        if self.kind == "controller":
            return "ctl"
        where = f"{self.role}" if self.role else ""
        return f"{where}:{self.kind}" + (f"({self.dim})" if self.dim is not None else "")


@attrs.frozen
class TensorSpec:
    shape: tuple[Size, ...]
    dtype: torch.dtype
    layout: Layout | None = None

    def __str__(self) -> str:
        dims = ",".join(str(size) for size in self.shape)
        return f"{DTYPE_NAMES.get(self.dtype, str(self.dtype))}[{dims}]"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def witness(self) -> torch.Tensor:
        """A meta tensor whose sizes witness this spec's dims."""
        return torch.empty([witness_size(size) for size in self.shape], dtype=self.dtype, device="meta")

    def numel(self, sizes: Mapping[str, int]) -> int:
        """Element count for concrete dim sizes, e.g. {"N": 256, "T": 16}."""
        total = 1
        for size in self.shape:
            total *= size if isinstance(size, int) else _concrete(size, sizes)
        return total

    def nbytes(self, sizes: Mapping[str, int]) -> int:
        return self.numel(sizes) * torch.empty((), dtype=self.dtype).element_size()


def _concrete(dim: Dim, sizes: Mapping[str, int]) -> int:
    value = 1
    for part in dim.name.split("*"):
        if part not in sizes:
            raise KeyError(f"no concrete size given for dim {part} ({DIM_MEANINGS.get(part, 'user dim')})")
        value *= sizes[part]
    return value


def spec_of_tensor(tensor: torch.Tensor) -> TensorSpec:
    """Map a witness-sized (meta) tensor back to a symbolic spec."""
    return TensorSpec(tuple(symbolic_size(size) for size in tensor.shape), tensor.dtype)


def f32(*shape: Size) -> TensorSpec:
    return TensorSpec(tuple(shape), torch.float32)


def i64(*shape: Size) -> TensorSpec:
    return TensorSpec(tuple(shape), torch.int64)


def boolean(*shape: Size) -> TensorSpec:
    return TensorSpec(tuple(shape), torch.bool)


@attrs.frozen
class RecordSpec:
    """A record of named tensor fields, e.g. `Rollouts[N,T]`."""

    kind: str
    fields: tuple[tuple[str, TensorSpec], ...]
    rows: Dim

    def field(self, name: str) -> TensorSpec | None:
        return dict(self.fields).get(name)

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)

    def __str__(self) -> str:
        other = "P" if self.kind == "Prompts" else "T"
        return f"{self.kind}[{self.rows},{other}]"


PROMPTS = RecordSpec("Prompts", (("ids", i64(B, P)), ("mask", boolean(B, P))), B)
ROLLOUTS = RecordSpec(
    "Rollouts",
    (
        ("prompt_ids", i64(N, P)), ("prompt_mask", boolean(N, P)), ("response_ids", i64(N, T)),
        ("mask", boolean(N, T)), ("logprobs", f32(N, T)), ("group", i64(N)),
    ),
    N,
)


@attrs.frozen
class ModelSpec:
    """A version of a model role: `policy@v` is the input version, `policy@v+1` after one update."""

    role: str
    version: int = 0
    kind: str = "lm"  # lm | critic

    def __str__(self) -> str:
        return f"{self.role}@v" + (f"+{self.version}" if self.version else "")

    def next(self) -> ModelSpec:
        return attrs.evolve(self, version=self.version + 1)


@attrs.frozen
class RewardSpec:
    """A reward role: a verifiable reward function or a reward model."""

    role: str

    def __str__(self) -> str:
        return "Reward"


@attrs.frozen
class EnvSpec:
    """An environment role (`state.env`): what `rg.rollout` steps between the policy's turns; the
    runtime binds it to the executor's environment recipe of that name."""

    role: str

    def __str__(self) -> str:
        return "Env"


@attrs.frozen
class StatsSpec:
    """Scalars an update reports (loss, grad norm, the loss closure's metrics)."""

    names: tuple[str, ...]

    def __str__(self) -> str:
        return "stats{" + ",".join(self.names) + "}"


@attrs.frozen
class TupleSpec:
    items: tuple[Any, ...]

    def __str__(self) -> str:
        return "(" + ", ".join(str(item) for item in self.items) + ")"


Spec = TensorSpec | RecordSpec | ModelSpec | RewardSpec | EnvSpec | StatsSpec | TupleSpec
