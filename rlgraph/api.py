"""The user API: `@rg.algorithm`, the `State` annotation and the primitives."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from rlgraph.agents import Env, Step, Tool, ToolEnv  # noqa: F401 - re-exported: rg.Env, rg.Step, rg.Tool, rg.ToolEnv
from rlgraph.ir import specs as S
from rlgraph.ir.errors import ConfigError
from rlgraph.ir.program import Program
from rlgraph.ir.tracing import DEFAULT_ROLES, check_algorithm_call, trace_algorithm


class State:
    """Annotation for an algorithm's first parameter: the versioned models and reward roles.

    While tracing, `state.policy` is a model version (`policy@v`); `state.replace(policy=p)`
    returns the next state. At run time the runtime holds the real models per role.
    """


class Algorithm:
    """An RL algorithm: one iteration `(state, batch, **hparams) -> (state, metrics)`.

    `algo.trace(**hparams)` returns the typed `Program` without running anything;
    `print(algo.trace())` shows it like a jaxpr.
    """

    def __init__(self, fn: Callable[..., Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = fn.__name__

    def trace(self, *, roles: Mapping[str, S.Spec] | None = None, **hparams: Any) -> Program:
        program = trace_algorithm(self.fn, roles=roles, hparams=hparams)
        return program.verify(after="trace")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Calling the algorithm inside another traced algorithm inlines it; on data it is a mistake.
        check_algorithm_call(self.fn, args)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<rg.algorithm {self.name}>"


def compile(algo: Algorithm, *, mesh: Any = None, placement: Any = None, sizes: Mapping[str, int] | None = None,
            models: Mapping[str, Any] | None = None, roles: Mapping[str, S.Spec] | None = None, engine: str = "auto",
            lora: Mapping[str, Any] | None = None, **hparams: Any):
    """Trace `algo` and lower it for `mesh` and `placement`; returns a `Compiled` to inspect and run.

    `sizes` gives the concrete dims byte counts use (B, P, T; n comes from the hparams),
    `models` maps roles to HF configs or presets (`"llama3-70b"`), `engine` the generation engine
    ("auto": native on a cpu mesh, vllm on GPUs; "native"; "vllm"), `lora` the roles that train LoRA
    adapters (`{"policy": {"r": 16, "target_modules": ["q_proj", "v_proj"]}}`: the memory plan
    counts their base weights frozen and their reference as sharing them). Nothing is run.
    """
    from rlgraph.passes import compile_program
    from rlgraph.passes.options import CompileOptions
    from rlgraph.plan.mesh import Colocated, Mesh

    if not isinstance(algo, Algorithm):  # a plain function would fail deep inside with "has no attribute 'trace'"
        raise ConfigError(f"rg.compile: {getattr(algo, '__name__', algo)!r} is not an algorithm",
                          fix="decorate the function with @rg.algorithm, then pass it to rg.compile")
    mesh = Mesh() if mesh is None else mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)  # Mesh.parse refuses mesh=8
    options = CompileOptions(mesh, placement or Colocated(), dict(sizes or {"B": 32, "n": 8, "P": 8, "T": 8}), dict(models or {}),
                             engine=engine, lora=lora)
    return compile_program(algo.trace(roles=roles, **hparams), options)


def algorithm(fn: Callable[..., Any]) -> Algorithm:
    """Decorator: mark a pure function `(state, batch, *, hparams) -> (state, metrics)` as an algorithm."""
    return Algorithm(fn)


def roles(**specs: S.Spec) -> dict[str, S.Spec]:
    """Declare the roles of a state, e.g. `rg.roles(policy=rg.lm("policy"), reward=rg.reward_fn("reward"))`."""
    return dict(specs)


def lm(role: str) -> S.ModelSpec:
    return S.ModelSpec(role, kind="lm")


def critic(role: str = "critic") -> S.ModelSpec:
    return S.ModelSpec(role, kind="critic")


def reward_fn(role: str = "reward") -> S.RewardSpec:
    return S.RewardSpec(role)


def env(role: str = "env") -> S.EnvSpec:
    """An environment role for `rg.rollout` (the default roles have one named "env")."""
    return S.EnvSpec(role)


__all__ = ["State", "Algorithm", "algorithm", "compile", "roles", "lm", "critic", "reward_fn", "env", "DEFAULT_ROLES",
           "Env", "Step", "Tool", "ToolEnv"]
